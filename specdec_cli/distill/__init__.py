"""Self-distillation of drafter heads for models that ship none (``specdec distill``)."""
