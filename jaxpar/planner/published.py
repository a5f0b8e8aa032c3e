"""A published result to check the planner against: the GPT weak-scaling table of Narayanan et
al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(arXiv 2104.04473, Table 1): A100-80GB, sequence 2048, vocabulary 51200, 8 GPUs per node.

Their throughput counts FLOPs as 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step (forward,
backward and full activation recomputation). We describe each GPT as a jaxpar model with the
same shapes (n_kv_heads = n_heads; a SwiGLU MLP of width 8h/3, which has the 4h MLP's parameters
and FLOPs), let the planner choose a layout for that GPU count and global batch on the
a100_80gb_x8 preset, and turn its predicted step time into their FLOP/s per GPU.

A third table checks the cost model where the planner's best plans live, without full
recomputation: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198; Table 3 layouts, Table 5 times): the same team's GPTs from 22B to 1T
on A100-80GB with tensor parallelism 8, sequence parallelism and selective recomputation (the
attention scores recomputed, as jaxpar's blockwise attention does), no data parallelism.

A second table checks the layout family the planner picks for the small GPTs, which Megatron's
table never ran: MosaicML llm-foundry's MPT training benchmarks
(scripts/train/benchmarking/README.md: PyTorch FSDP FULL_SHARD, i.e. ZeRO-3, bf16, sequence
2048, vocabulary 50368, flash attention, on A100s, 8 a node, 1600 Gb/s RoCE between nodes), with
model FLOPs utilization counted as 6 N + 12 l h s FLOPs per token (no recomputation credited).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpar.config import Config, make_config

SEQ, VOCAB = 2048, 51200
# What dropping full activation recomputation gained the same team on the same GPUs: Korthikanti
# et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198),
# a 530B GPT on 2240 A100s at 54.2% model FLOPs utilization against 42.1% with recomputation.
# A best plan that keeps its activations (outside the FULL_SHARD family, below) is held to the
# published figure times this (in the paper's FLOP units, which credit the recomputation it skips).
NO_RECOMPUTE_GAIN = 54.2 / 42.1


def gpt_config(hidden: int, heads: int, layers: int, batch: int, vocab: int, tied: bool,
               reduce_dtype: str = "float32", base: dict | None = None) -> Config:
    """A published GPT as a jaxpar model: n_kv_heads = n_heads, a SwiGLU MLP of width 8h/3 (rounded
    up to a multiple of 128: the 4h MLP's parameters and FLOPs), bf16 compute, fp32 weights,
    gradients reduced in `reduce_dtype`."""
    ffn = -(-8 * hidden // 3 // 128) * 128
    return make_config({
        "model": {"vocab_size": vocab, "dim": hidden, "n_layers": layers, "n_heads": heads,
                  "n_kv_heads": heads, "ffn_dim": ffn, "tie_embeddings": tied, "attention": "blockwise"},
        "train": {"global_batch": batch, "seq_len": SEQ, "compute_dtype": "bfloat16",
                  "param_dtype": "float32", "grad_reduce_dtype": reduce_dtype},
        "sharding": {"replicated_tolerance": 0.5}, "data": {"source": "synthetic"}, **(base or {})})


@dataclass(frozen=True)
class GPTRun:
    name: str
    heads: int
    hidden: int
    layers: int
    tensor: int          # the paper's layout
    pipeline: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved, as published

    def megatron_flops(self) -> float:
        """FLOPs per step by the paper's formula (with recomputation)."""
        b, s, l, h, v = self.batch, SEQ, self.layers, self.hidden, VOCAB
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def model_flops(self) -> float:
        """FLOPs per step without recomputation: 6 N + 12 l h s a token (llm-foundry's MFU
        count; N the layers' 12 l h^2 and the V h head)."""
        b, s, l, h, v = self.batch, SEQ, self.layers, self.hidden, VOCAB
        return b * s * (6 * (12 * l * h * h + v * h) + 12 * l * h * s)

    def config(self, base: dict | None = None) -> Config:
        return gpt_config(self.hidden, self.heads, self.layers, self.batch, VOCAB, tied=False, base=base)


WEAK_SCALING = [
    GPTRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    GPTRun("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    GPTRun("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    GPTRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    GPTRun("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    GPTRun("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    GPTRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    GPTRun("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    GPTRun("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    GPTRun("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


MPT_VOCAB = 50368


@dataclass(frozen=True)
class ShardedRun:
    """One FULL_SHARD row of llm-foundry's table: the MPT model's shape, the GPUs, the global
    batch, whether it recomputed activations, and its published MFU (percent)."""
    name: str
    hidden: int
    heads: int
    layers: int
    gpus: int
    batch: int
    remat: bool
    mfu: float
    params: int      # as published (the tied embedding and the learned positions included)
    card: str        # a100_80gb or a100_40gb (the same compute and links; timed on the 80 GB preset)
    # Composer's FSDP mixed precision as published: DEFAULT (these 80 GB rows; float32 gradient
    # reduction in its current definition) or PURE (the 40 GB rows: bf16 gathers and reductions)
    mixed: str = "DEFAULT"

    def model_flops(self) -> float:
        """FLOPs per step by llm-foundry's MFU formula (forward and backward, no recompute)."""
        return self.batch * SEQ * (6 * self.params + 12 * self.layers * self.hidden * SEQ)

    def config(self) -> Config:
        return gpt_config(self.hidden, self.heads, self.layers, self.batch, MPT_VOCAB, tied=True,
                          reduce_dtype="bfloat16" if self.mixed == "PURE" else "float32")


# sequence 2048, bf16, FULL_SHARD; one node of A100-80GB, and 32 to 128 A100-40GB
FULL_SHARD = [
    ShardedRun("125m", 768, 12, 12, 8, 640, False, 44.79, 125311488, "a100_80gb"),
    ShardedRun("350m", 1024, 16, 24, 8, 512, False, 51.62, 355985408, "a100_80gb"),
    ShardedRun("760m", 1536, 12, 24, 8, 384, False, 56.85, 760470528, "a100_80gb"),
    ShardedRun("1b", 2048, 16, 24, 8, 448, False, 59.86, 1315950592, "a100_80gb"),
    ShardedRun("3b", 2560, 20, 32, 8, 160, False, 62.11, 2651837440, "a100_80gb"),
    ShardedRun("7b", 4096, 32, 32, 8, 96, False, 64.23, 6658859008, "a100_80gb"),
    ShardedRun("13b", 5120, 40, 40, 8, 48, False, 59.57, 12853954560, "a100_80gb"),
    ShardedRun("760m", 1536, 12, 24, 32, 384, False, 51.97, 760470528, "a100_40gb", "PURE"),
    ShardedRun("760m", 1536, 12, 24, 128, 1536, False, 50.73, 760470528, "a100_40gb", "PURE"),
    ShardedRun("1b", 2048, 16, 24, 32, 320, False, 45.39, 1315950592, "a100_40gb", "PURE"),
    ShardedRun("1b", 2048, 16, 24, 64, 640, False, 55.44, 1315950592, "a100_40gb", "PURE"),
    ShardedRun("1b", 2048, 16, 24, 128, 1280, False, 54.41, 1315950592, "a100_40gb", "PURE"),
    ShardedRun("3b", 2560, 20, 32, 32, 192, False, 56.96, 2651837440, "a100_40gb", "PURE"),
    ShardedRun("3b", 2560, 20, 32, 64, 384, False, 55.94, 2651837440, "a100_40gb", "PURE"),
    ShardedRun("3b", 2560, 20, 32, 128, 768, False, 54.80, 2651837440, "a100_40gb", "PURE"),
]


@dataclass(frozen=True)
class SelectiveRun:
    """One row of Korthikanti et al. 2022: the GPT's shape, the paper's layout (tensor, pipeline,
    interleaved chunks per stage, the microbatch), the global batch, and the published iteration
    time and model FLOPs utilization (percent)."""
    name: str
    heads: int
    hidden: int
    layers: int
    tensor: int
    pipeline: int
    virtual: int      # the interleaved schedule's model chunks per stage (1: plain 1F1B)
    gpus: int
    batch: int
    micro: int        # sequences per microbatch
    step_s: float
    mfu: float

    def model_flops(self) -> float:
        """FLOPs per step by the paper's MFU count, 72 B l s h^2 (1 + s / 6h + V / 12 l h): forward
        and backward, no recomputation."""
        b, s, l, h, v = self.batch, SEQ, self.layers, self.hidden, VOCAB
        return 72 * b * l * s * h * h * (1 + s / (6 * h) + v / (12 * l * h))

    def config(self) -> Config:
        """The GPT with the paper's sequence parallelism."""
        sharding = {"replicated_tolerance": 0.5, "sequence_parallel": True}
        return gpt_config(self.hidden, self.heads, self.layers, self.batch, VOCAB, tied=False,
                          base={"sharding": sharding})


SELECTIVE = [
    SelectiveRun("22B", 64, 6144, 48, 8, 1, 1, 8, 4, 4, 1.10, 41.5),
    SelectiveRun("175B", 96, 12288, 96, 8, 8, 3, 64, 64, 1, 13.75, 51.4),
    SelectiveRun("530B", 128, 20480, 105, 8, 35, 3, 280, 280, 1, 37.83, 56.0),
    SelectiveRun("1T", 160, 25600, 128, 8, 64, 1, 512, 512, 1, 71.49, 56.3),
]


def _planning(cfg: Config, cluster_name: str, gpus: int):
    """The config, the cluster preset at `gpus` devices and the model a published row is planned on."""
    from jaxpar.planner.cluster import load_cluster
    from jaxpar.train.builtin import llama_model_factory
    from jaxpar.train.model import ModelDef
    return cfg, load_cluster(cluster_name).with_devices(gpus), ModelDef.from_factory(llama_model_factory(cfg))


def _mfu(flops: float, scored, gpus: int, cluster) -> float:
    """Model FLOPs utilization (percent) of `flops` a step at the scored plan's predicted step time."""
    return 100 * flops / scored.time.step_s / gpus / cluster.peak("bfloat16")


def check_sharded_run(run: ShardedRun, cluster_name: str = "a100_80gb_x8") -> dict:
    """For one FULL_SHARD row: the cost model's MFU for its layout (fsdp over every GPU, ZeRO-3,
    its remat; the planner picks the accumulation that fits) against the published MFU."""
    from jaxpar.planner.search import search
    cfg, cluster, model = _planning(run.config(), cluster_name, run.gpus)
    res = search(cfg, cluster, model, fixed={"fsdp": run.gpus},
                 options_fixed={"zero_stage": 3, "remat": "full" if run.remat else "none"})
    out = {"run": f"{run.name}@{run.gpus}", "published_mfu": run.mfu}
    if res.ranked:
        best = res.ranked[0]
        mfu = _mfu(run.model_flops(), best, run.gpus, cluster)
        out.update(plan=best.layout.label(), predicted_mfu=mfu, residual=mfu / run.mfu - 1,
                   memory_gib=best.memory["total"] / 2**30)
    return out


def check_selective_run(run: SelectiveRun, cluster_name: str = "a100_80gb_x8") -> dict:
    """For one of Korthikanti et al.'s rows: the cost model's step time and MFU for the paper's
    layout (tensor 8, its pipeline and microbatches, no data parallelism, no optimizer sharding,
    remat none with blockwise attention: selective recomputation; sequence parallelism; a
    pipeline as Megatron-LM runs it, the `dataflow` clock) against the published ones. Time is
    what is checked: the memory is jaxpar's (float32 weights and gradients beside Adam's state
    and its update's transient, ~20 bytes a parameter against Megatron's 18, and a stage's vjp
    residuals as stashed), reported as `memory_gib` and not held to the budget (the pipelined
    rows need 76-127 GiB: jaxpar's 1f1b holds up to 2p - 1 stage inputs where Megatron's holds
    p, as jaxpar's 1f1b_split does at another lockstep time; docs/planner.md)."""
    from jaxpar.planner.search import search
    cfg, cluster, model = _planning(run.config(), cluster_name, run.gpus)
    opts = {"remat": "none", "zero_stage": 0, "grad_accum": run.batch // run.micro,
            "sequence_parallel": True}
    clock = "lockstep"
    if run.pipeline > 1:
        opts.update(schedule="interleaved_1f1b" if run.virtual > 1 else "1f1b",
                    virtual_stages=run.virtual, recompute=False)
        clock = "dataflow"
        cluster = cluster.model_copy(update={"memory_gib": 1e6})
    fixed = {"tensor": run.tensor, "pipeline": run.pipeline, "fsdp": 1,
             "data": run.gpus // (run.tensor * run.pipeline)}
    res = search(cfg, cluster, model, fixed=fixed, options_fixed=opts, clock=clock)
    out = {"run": run.name, "gpus": run.gpus, "published_s": run.step_s, "published_mfu": run.mfu}
    if res.ranked:
        p = res.ranked[0]
        mfu = _mfu(run.model_flops(), p, run.gpus, cluster)
        out.update(plan=p.layout.label(), predicted_s=p.time.step_s, predicted_mfu=mfu,
                   residual=mfu / run.mfu - 1, memory_gib=p.memory["total"] / 2**30)
    return out


def full_shard_family(layout) -> bool:
    """ZeRO-3 over the data-parallel devices, no tensor or pipeline split, no recomputation: what
    FULL_SHARD runs (the planner's HSDP, fsdp in a node and data across, included)."""
    return (layout.zero_stage == 3 and layout.size("tensor") == 1 and layout.size("pipeline") == 1
            and layout.remat == "none")


def nearest_sharded(hidden: int, gpus: int) -> list[ShardedRun]:
    """The FULL_SHARD rows (without recomputation) nearest in width, then in GPU count; rows
    as near on both count alike."""
    rows = [r for r in FULL_SHARD if not r.remat]
    dist = lambda r: (abs(r.hidden - hidden), abs(math.log2(r.gpus / gpus)))
    width = min(dist(r)[0] for r in rows)
    rows = [r for r in rows if dist(r)[0] == width]
    near = min(dist(r)[1] for r in rows)
    return [r for r in rows if dist(r)[1] == near]


def recomputes(layout) -> bool:
    """Whether a plan runs every forward twice: remat full, or a pipeline stage's recompute."""
    return layout.remat == "full" or (layout.size("pipeline") > 1 and layout.recompute)


def check_run(run: GPTRun, cluster_name: str = "a100_80gb_x8", free: bool = True) -> dict:
    """For one row: the cost model's FLOP/s per GPU for the paper's own layout (its tensor and
    pipeline sizes, data parallel over the rest, full recomputation, no optimizer sharding; the
    planner picks the microbatching, and for a pipeline Megatron's schedule, 1F1B or the
    interleaved one with v = 2, timed as Megatron runs it) against the published figure; and the
    planner's free choice: its best plan, whether it keeps tensor parallelism inside a node and
    fits, and its predicted FLOP/s in the paper's units, beside the published measurement it is
    held to (`reference`) (`free` False: the paper's layout only)."""
    from jaxpar.planner.search import search
    cfg, cluster, model = _planning(run.config(), cluster_name, run.gpus)
    tflops = lambda scored: run.megatron_flops() / scored.time.step_s / run.gpus / 1e12
    fixed = {"tensor": run.tensor, "pipeline": run.pipeline, "fsdp": 1}
    paper_opts = {"remat": "full", "zero_stage": 0, "recompute": False, "sequence_parallel": False}
    if run.pipeline > 1:
        # the paper's pipelines as Megatron-LM runs them: 1F1B, or its interleaved schedule (not
        # for 2 stages), each device's ops back to back as their inputs arrive (timing.CLOCKS)
        scheds = ("1f1b",) if run.pipeline == 2 else ("1f1b", "interleaved_1f1b")
        results = [search(cfg, cluster, model, fixed=fixed, options_fixed={**paper_opts, "schedule": s},
                          clock="dataflow") for s in scheds]
        paper = results[0]
        for r in results[1:]:
            paper.ranked = sorted(paper.ranked + r.ranked, key=lambda x: x.time.step_s)
    else:
        paper = search(cfg, cluster, model, fixed=fixed, options_fixed=paper_opts)
    out = {"run": run.name, "gpus": run.gpus, "published_tflops": run.tflops_per_gpu,
           "paper_layout": f"tensor={run.tensor} pipeline={run.pipeline}"}
    if paper.ranked:
        p = paper.ranked[0]
        out.update(paper_plan=p.layout.label(), predicted_tflops=tflops(p),
                   residual=tflops(p) / run.tflops_per_gpu - 1, paper_memory_gib=p.memory["total"] / 2**30)
    if free and (res := search(cfg, cluster, model)).ranked:
        best = res.ranked[0]
        lay = best.layout
        out.update(plan=lay.label(), tensor=lay.size("tensor"),
                   tensor_in_node=lay.size("tensor") <= cluster.devices_per_host and "tensor" not in lay.dcn,
                   memory_gib=best.memory["total"] / 2**30, fits=best.memory["total"] <= cluster.memory_bytes,
                   best_tflops=tflops(best), best_recomputes=recomputes(lay),
                   best_mfu=_mfu(run.model_flops(), best, run.gpus, cluster),
                   **reference(run, lay, cluster))
    return out


def reference(run: GPTRun, layout, cluster) -> dict:
    """What a best plan is held to. A FULL_SHARD-family plan: the published MFU of the nearest
    FULL_SHARD rows (width, then GPU count; their mean), in the paper's FLOP units. Any other:
    the paper's figure, times NO_RECOMPUTE_GAIN where the plan skips full recomputation."""
    if full_shard_family(layout):
        rows = nearest_sharded(run.hidden, run.gpus)
        mfu = sum(r.mfu for r in rows) / len(rows)
        units = run.megatron_flops() / run.model_flops()
        return {"reference_tflops": mfu / 100 * cluster.peak("bfloat16") / 1e12 * units,
                "reference_mfu": mfu,
                "reference": "FULL_SHARD " + ", ".join(f"{r.name}@{r.gpus}" for r in rows)}
    gain = 1.0 if recomputes(layout) else NO_RECOMPUTE_GAIN
    return {"reference_tflops": run.tflops_per_gpu * gain,
            "reference": "Megatron" + ("" if gain == 1.0 else " x no-recompute gain")}
