"""The actor runtime and shared contracts: typed config, messages, transport. No model code."""
