"""Quantisation-aware training: fake-quantised modules, the prepare step, the distillation loss."""
