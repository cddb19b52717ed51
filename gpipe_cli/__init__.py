"""gpipe-cli: GPipe pipeline-parallel training driven by YAML recipes."""

import os

__version__ = "0.1.0"

# Offload's copies and the schedules' micro-batches free blocks of many sizes; segments that grow in place
# keep the CUDA allocator's reserved memory near what is allocated. Set before torch loads; a user's own
# setting (either name) wins.
if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
