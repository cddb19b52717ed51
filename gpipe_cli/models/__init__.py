"""The model zoo: AmoebaNet and Transformer as flat lists of independently buildable pipeline layers."""

# Import from the modules (`registry`, `describe`, `families`, ...): the package itself loads nothing, so that the
# families' facts load without torch.
