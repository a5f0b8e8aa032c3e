"""The YAML config of the tests that train in other processes (jaxpar launch, SLURM, SIGKILL and
resume): the tiny model on data=2 x fsdp=2 x tensor=2 ZeRO-1, synthetic data, every step logged;
each file chooses its run name, step count and checkpoint policy. The learning-rate schedule is
the same for every step count (decay over DECAY_STEPS), so the files compile the same programs
and the processes of one test run load each other's from the compilation cache (CACHE_ENV)."""
import os

DECAY_STEPS = 16
# what a test's subprocesses add to their environment: the test run's compilation cache
# (tests/conftest.py), entries of any compile time and size
CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", ""),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def layout_run_yaml(name: str, steps: int, checkpoint: str) -> str:
    """`checkpoint`: the body of the checkpoint mapping, e.g. "every: 3, keep_last: 3"; `steps`
    at most DECAY_STEPS."""
    assert steps <= DECAY_STEPS, steps
    return f"""\
name: {name}
model: {{preset: tiny, n_layers: 2}}
mesh: {{data: 2, fsdp: 2, tensor: 2}}
sharding: {{zero_stage: 1}}
train: {{steps: {steps}, global_batch: 16, seq_len: 32, compute_dtype: float32, progress: false,
        log_every: 1}}
optimizer: {{warmup_steps: 1, decay_steps: {DECAY_STEPS}}}
data: {{source: synthetic}}
checkpoint: {{{checkpoint}}}
"""
