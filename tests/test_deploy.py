"""The deploy/ templates: each renders, parses (YAML; bash for the SLURM script) and carries
its priority, queue and signal settings; a value with quotes, newlines, `#`, `$(...)` or `: `
comes back as one string in its place (the parsed structure is that of a plain value), and
the SLURM script, run with stub commands, passes it to srun as one argument and runs nothing
else. Ints are checked, comment-line values restricted, the save allowance within the notice."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
sys.path.insert(0, str(DEPLOY))
from render import RenderError, main, render  # noqa: E402

sys.path.pop(0)

EVIL = 'x" \'y\'\n  injected: true\n- z: [1]\n# c: $(touch PWNED) `touch PWNED`; touch PWNED\u2028\x85end\\'
JOB = dict(NAME="llm", IMAGE="ghcr.io/me/jaxpar:1", NODES="4", GPUS_PER_NODE="8",
           CONFIG="configs/llama_1b.yaml", PVC="ckpt")


def _render(rel: str, **values) -> str:
    return render((DEPLOY / rel).read_text(), values, rel)


def _docs(rel: str, **values) -> dict:
    out = {}
    for d in yaml.safe_load_all(_render(rel, **values)):
        out.setdefault(d["kind"], []).append(d)
    return out


def _replace(tree, old: str, new: str):
    """`tree` with `old` replaced by `new` in every string."""
    if isinstance(tree, dict):
        return {_replace(k, old, new): _replace(v, old, new) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_replace(v, old, new) for v in tree]
    return tree.replace(old, new) if isinstance(tree, str) else tree


def _strings(tree) -> set:
    if isinstance(tree, dict):
        return set().union(*map(_strings, tree.keys()), *map(_strings, tree.values()))
    if isinstance(tree, list):
        return set().union(*map(_strings, tree))
    return {tree} if isinstance(tree, str) else set()


def _container(pod_spec: dict) -> tuple[dict, dict]:
    c = pod_spec["containers"][0]
    return c, {e["name"]: e for e in c["env"]}


def test_jobset_with_kueue_labels_and_grace():
    docs = _docs("k8s/jobset.yaml", **JOB, QUEUE="team-a", PRIORITY_CLASS="jaxpar-high", GRACE_S="600")
    js = docs["JobSet"][0]
    assert js["apiVersion"].startswith("jobset.x-k8s.io/")
    labels = js["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
    assert labels["kueue.x-k8s.io/priority-class"] == "jaxpar-high"
    rj = js["spec"]["replicatedJobs"][0]
    spec = rj["template"]["spec"]
    assert spec["parallelism"] == spec["completions"] == 4 and spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 600
    c, env = _container(pod)
    assert env["JAXPAR_NUM_PROCESSES"]["value"] == "4"
    assert env["JAXPAR_COORDINATOR_ADDRESS"]["value"] == f"llm-{rj['name']}-0-0.llm:12355"
    assert "job-completion-index" in env["JAXPAR_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert c["command"][:3] == ["jaxpar", "train", "configs/llama_1b.yaml"]
    assert "checkpoint.preemption_grace_s=240" in c["command"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["ports"][0]["containerPort"] == 12355


def test_kueue_queue_objects():
    d = _docs("k8s/kueue-queues.yaml", GPUS="64", NAMESPACE="team-a")
    cq, lq = d["ClusterQueue"][0], d["LocalQueue"][0]
    assert cq["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    quota = cq["spec"]["resourceGroups"][0]["flavors"][0]
    assert quota["name"] == d["ResourceFlavor"][0]["metadata"]["name"]
    assert quota["resources"][0] == {"name": "nvidia.com/gpu", "nominalQuota": 64}
    assert lq["metadata"]["namespace"] == "team-a" and lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    # the names jobset.yaml uses by default exist here
    js = _docs("k8s/jobset.yaml", **JOB)["JobSet"][0]["metadata"]["labels"]
    assert js["kueue.x-k8s.io/queue-name"] == lq["metadata"]["name"]
    classes = {w["metadata"]["name"]: w["value"] for w in d["WorkloadPriorityClass"]}
    assert js["kueue.x-k8s.io/priority-class"] in classes
    assert classes["jaxpar-low"] < classes["jaxpar-normal"] < classes["jaxpar-high"]


def test_volcano_job_queue_and_priority():
    job = _docs("volcano/job.yaml", **JOB, QUEUE="team-a", PRIORITY_CLASS="jaxpar-high")["Job"][0]
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1" and job["spec"]["schedulerName"] == "volcano"
    assert job["spec"]["queue"] == "team-a" and job["spec"]["priorityClassName"] == "jaxpar-high"
    assert job["spec"]["minAvailable"] == 4 and set(job["spec"]["plugins"]) == {"svc", "env"}
    assert {"event": "PodEvicted", "action": "RestartJob"} in job["spec"]["policies"]
    task = job["spec"]["tasks"][0]
    assert task["replicas"] == 4
    pod = task["template"]["spec"]
    assert pod["priorityClassName"] == "jaxpar-high" and pod["terminationGracePeriodSeconds"] == 300
    c, env = _container(pod)
    assert env["JAXPAR_COORDINATOR_ADDRESS"]["value"] == f"llm-{task['name']}-0.llm:12355"
    assert env["JAXPAR_NUM_PROCESSES"]["value"] == "4"
    assert "distributed.process_id=$(VC_TASK_INDEX)" in c["command"]
    q = _docs("volcano/queue.yaml", GPUS="64")
    assert q["Queue"][0]["metadata"]["name"] == job["spec"]["queue"].replace("team-a", "jaxpar")
    assert q["Queue"][0]["spec"]["capability"]["nvidia.com/gpu"] == 64
    pcs = {p["metadata"]["name"]: p for p in q["PriorityClass"]}
    assert pcs["jaxpar-high"]["value"] > pcs["jaxpar-normal"]["value"]
    assert pcs["jaxpar-high"]["preemptionPolicy"] == "PreemptLowerPriority"


def test_slurm_script_carries_requeue_signal_and_parses(tmp_path):
    script = _render("slurm/jaxpar.sbatch", JOB_NAME="llm", NODES="2", GPUS_PER_NODE="8",
                     CONFIG="configs/llama_1b.yaml", WORKDIR="/home/me/jaxpar", PREEMPT_NOTICE_S="600")
    assert not re.search(r"\{\{\s*[A-Z]", script)
    sb = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.M))
    assert sb["nodes"] == "2" and sb["ntasks-per-node"] == "1" and sb["gpus-per-node"] == "8", sb
    assert sb["signal"] == "TERM@600" and "#SBATCH --requeue" in script
    assert "checkpoint.preemption_grace_s=240" in script
    assert re.search(r"^srun .*jaxpar train configs/llama_1b.yaml", script, re.M), script
    assert "export XLA_FLAGS" not in script  # the GPU variant: no forced CPU devices
    f = tmp_path / "job.sbatch"
    f.write_text(script)
    r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # the CPU variant: no GPU line, tasks per node and forced CPU devices
    cpu = _render("slurm/jaxpar.sbatch", JOB_NAME="llm", NODES="1", TASKS_PER_NODE="2", CPUS_PER_TASK="1",
                  XLA_FLAGS="--xla_force_host_platform_device_count=4", CONFIG="c.yaml", WORKDIR="/w")
    assert "gpus-per-node" not in cpu and "--ntasks-per-node=2" in cpu
    assert "export XLA_FLAGS=--xla_force_host_platform_device_count=4" in cpu
    with pytest.raises(KeyError, match="NODES"):
        _render("slurm/jaxpar.sbatch", JOB_NAME="x")


def test_yaml_values_cannot_inject():
    """Every string value at once: the parsed documents are those of plain values, with EVIL
    in their places as one string; an int slot refuses text."""
    for rel, values in [("k8s/jobset.yaml", dict(JOB, QUEUE="Q", PRIORITY_CLASS="P", WORKDIR="W")),
                        ("volcano/job.yaml", dict(JOB, QUEUE="Q", PRIORITY_CLASS="P", WORKDIR="W")),
                        ("k8s/kueue-queues.yaml", dict(GPUS="8", NAMESPACE="N", QUEUE="Q", FLAVOR="F")),
                        ("volcano/queue.yaml", dict(GPUS="8", QUEUE="Q"))]:
        strings = {k: v for k, v in values.items() if not v.isdigit()}
        plain = {k: f"SAFE{i}SAFE" for i, k in enumerate(strings)}
        safe = list(yaml.safe_load_all(_render(rel, **{**values, **plain})))
        evil = {k: f"{EVIL}{i}" for i, k in enumerate(strings)}
        got = list(yaml.safe_load_all(_render(rel, **{**values, **evil})))
        want = safe
        for k in strings:
            want = _replace(want, plain[k], evil[k])
        assert got == want, rel
        assert f"{EVIL}0" in _strings(got), rel  # the value came back whole, as one string
        int_slot = next(k for k, v in values.items() if v.isdigit())
        with pytest.raises(RenderError, match=f"{int_slot}=.*whole number"):
            _render(rel, **{**values, int_slot: "8\ninjected: true"})


def test_slurm_values_cannot_inject(tmp_path):
    """The rendered script runs with stub srun / activate: srun gets EVIL as one argument each
    time, nothing else runs (no PWNED file), and EVIL cannot go on an #SBATCH line."""
    work = tmp_path / ("w " + EVIL.replace("\\", "").replace("/", ""))
    (work / "venv" / "bin").mkdir(parents=True)
    (work / "venv" / "bin" / "activate").write_text("")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    argv_file = str(tmp_path / "argv.json")
    (stubs / "srun").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                f"open({argv_file!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    (stubs / "srun").chmod(0o755)
    script = _render("slurm/jaxpar.sbatch", JOB_NAME="llm", NODES="1", CONFIG=EVIL, WORKDIR=str(work),
                     VENV="venv", RUN_DIR=EVIL, NCCL_SOCKET_IFNAME=EVIL, XLA_FLAGS=EVIL,
                     OVERRIDES="a=1 " + shlex.quote(EVIL))
    f = tmp_path / "job.sbatch"
    f.write_text(script)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", SLURM_JOB_ID="1", SLURM_JOB_NUM_NODES="1",
               SLURM_JOB_NODELIST="n1")
    env.pop("NCCL_SOCKET_IFNAME", None)
    r = subprocess.run(["bash", str(f)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    i = argv.index("train")
    assert argv[i + 1] == EVIL and argv[i + 2] == "run_dir=" + EVIL, argv
    assert argv[-2:] == ["a=1", EVIL], argv
    assert not list(tmp_path.rglob("PWNED")) and not list(Path.cwd().glob("PWNED"))
    probe = subprocess.run(["bash", "-c", f"source {f} >/dev/null; echo \"$XLA_FLAGS|$NCCL_SOCKET_IFNAME\""],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert probe.stdout == f"{EVIL}|{EVIL}\n", probe
    with pytest.raises(RenderError, match="JOB_NAME=.*comment line"):
        _render("slurm/jaxpar.sbatch", JOB_NAME="x\nrm -rf /", NODES="1", CONFIG="c", WORKDIR="/w")
    with pytest.raises(RenderError, match="NODES=.*whole number"):
        _render("slurm/jaxpar.sbatch", JOB_NAME="x", NODES="1 --uid=0", CONFIG="c", WORKDIR="/w")


def test_save_allowance_within_the_notice(capsys):
    with pytest.raises(RenderError, match="SAVE_GRACE_S=400 must be <= PREEMPT_NOTICE_S=300"):
        _render("slurm/jaxpar.sbatch", JOB_NAME="x", NODES="1", CONFIG="c", WORKDIR="/w", SAVE_GRACE_S="400")
    with pytest.raises(RenderError, match="SAVE_GRACE_S=240 must be <= GRACE_S=60"):
        _render("k8s/jobset.yaml", **JOB, GRACE_S="60")
    # the CLI: one line naming the field, exit 2; a typo'd name is named too
    assert main([str(DEPLOY / "volcano/job.yaml"), *[f"{k}={v}" for k, v in JOB.items()], "GRACE_S=60"]) == 2
    assert "SAVE_GRACE_S=240 must be <= GRACE_S=60" in capsys.readouterr().err
    assert main([str(DEPLOY / "volcano/queue.yaml"), "GPUS=8", "QUEUEE=x"]) == 2
    assert "no placeholder QUEUEE" in capsys.readouterr().err
