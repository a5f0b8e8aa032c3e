"""The YAML config of the tests that train in other processes (jaxpar launch, SLURM, SIGKILL and
resume): the tiny model on data=2 x fsdp=2 x tensor=2 ZeRO-1, synthetic data, every step logged;
each file chooses its run name, step count and checkpoint policy."""


def layout_run_yaml(name: str, steps: int, checkpoint: str) -> str:
    """`checkpoint`: the body of the checkpoint mapping, e.g. "every: 3, keep_last: 3"."""
    return f"""\
name: {name}
model: {{preset: tiny, n_layers: 2}}
mesh: {{data: 2, fsdp: 2, tensor: 2}}
sharding: {{zero_stage: 1}}
train: {{steps: {steps}, global_batch: 16, seq_len: 32, compute_dtype: float32, progress: false,
        log_every: 1}}
optimizer: {{warmup_steps: 1, decay_steps: {steps}}}
data: {{source: synthetic}}
checkpoint: {{{checkpoint}}}
"""
