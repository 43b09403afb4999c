"""openpi JAX checkpoints -> policy directories: the strict key maps and streaming drivers for pi0
(``pi0.conversion.pi0``) and pi0-FAST (``pi0.conversion.pi0fast``), the openpi TrainConfig presets
(``openpi_configs``) and zero-valued openpi trees for memory tests (``zero_checkpoint``). Reading orbax needs the
optional ``convert`` extra (CPU JAX + orbax-checkpoint)."""
