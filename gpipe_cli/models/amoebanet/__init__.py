"""AmoebaNet-D and AmoebaNet-B image classifiers as pipeline layer sequences."""

from gpipe_cli.models.amoebanet.genotype import AMOEBANET_B, AMOEBANET_D, GENOTYPES, CellGenotype, Genotype
from gpipe_cli.models.amoebanet.network import amoebanet_loss, build_amoebanet, plan_cells

__all__ = ["AMOEBANET_B", "AMOEBANET_D", "GENOTYPES", "CellGenotype", "Genotype", "amoebanet_loss",
           "build_amoebanet", "plan_cells"]
