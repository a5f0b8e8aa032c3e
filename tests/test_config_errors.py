"""Bad input gets a clear error naming the field, the value and what is valid."""
import re

import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError, load_config, make_config
from jaxpar.mesh import build_mesh, resolve_sizes
from jaxpar.train.trainer import Trainer
from tests.conftest import TINY, tiny_config


def test_mesh_product_mismatch(devices):
    cfg = make_config({}, ["mesh.data=2", "mesh.tensor=2"])
    with pytest.raises(ConfigError, match=r"data=2.*tensor=2.* multiplies to 4 but there are 8 devices"):
        build_mesh(cfg.mesh, devices)


def test_fill_axis_must_divide():
    cfg = make_config({}, ["mesh.data=-1", "mesh.tensor=3"])
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        resolve_sizes(cfg.mesh, 8)


def test_fill_axis_resolves():
    cfg = make_config({}, ["mesh.data=-1", "mesh.tensor=2"])
    assert resolve_sizes(cfg.mesh, 8)["data"] == 4


def test_negative_size():
    with pytest.raises(ConfigError, match=r"mesh.fsdp = -3: .*positive integer or -1"):
        make_config({}, ["mesh.fsdp=-3"])


def test_two_fill_axes():
    with pytest.raises(ConfigError, match="only one axis may be -1"):
        make_config({}, ["mesh.data=-1", "mesh.fsdp=-1"])


def test_unknown_key_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown key 'train.stpes'. did you mean 'steps'"):
        make_config({}, ["train.stpes=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'modle'. did you mean 'model'"):
        make_config({"modle": {}})


def test_heads_not_divisible_by_tensor(devices):
    cfg = tiny_config("mesh.data=1", "mesh.tensor=8")
    with pytest.raises(ConfigError, match=r"model.n_heads=4 is not divisible by mesh.tensor=8"):
        Trainer(cfg, devices=devices)


def test_global_batch_not_divisible(devices):
    cfg = tiny_config("mesh.data=8", "train.global_batch=12")
    with pytest.raises(ConfigError, match=r"train.global_batch=12 must be divisible .* = 8"):
        Trainer(cfg, devices=devices)


def test_dim_not_divisible_names_param(devices):
    cfg = tiny_config("mesh.data=1", "mesh.fsdp=8", "sharding.zero_stage=3", "model.dim=132",
                      "model.head_dim=32")
    with pytest.raises(ConfigError, match=r"dim .* \('embed'\) has size 132, not divisible by mesh axes fsdp = 8"):
        Trainer(cfg, devices=devices)


def test_replicated_tolerance(devices):
    cfg = tiny_config("mesh.data=4", "mesh.tensor=2", "sharding.rules.mlp=[]", "sharding.rules.heads=[]",
                      "sharding.rules.kv_heads=[]", "sharding.rules.vocab=[]")
    with pytest.raises(ConfigError, match=r"replicated where this layout means to shard them, above sharding.replicated_tolerance=0.05; largest: ") as e:
        Trainer(cfg, devices=devices)
    # the error's own suggestion is a tolerance that accepts this layout
    suggested = re.search(r"accept it with (sharding.replicated_tolerance=[0-9.]+)", str(e.value)).group(1)
    Trainer(make_config({}, [*TINY, "mesh.data=4", "mesh.tensor=2", "sharding.rules.mlp=[]",
                             "sharding.rules.heads=[]", "sharding.rules.kv_heads=[]", "sharding.rules.vocab=[]",
                             suggested]), devices=devices, log=lambda s: None)


@pytest.mark.parametrize("layout", [
    ["mesh.data=4", "mesh.pipeline=2", "train.grad_accum=2"],                       # embed, head per stage
    ["model.preset=moe_tiny", "model.n_layers=2", "mesh.data=4", "mesh.expert=2"],  # attention per expert
])
def test_replication_by_design_is_accepted_and_a_lost_rule_is_not(devices, layout):
    """Pipelines and expert parallelism leave some weights whole on purpose (14% and 19% of the
    bytes here): the default tolerance accepts them and the banner still reports the share. The
    same layouts with the rule that splits their params emptied are refused."""
    t = Trainer(tiny_config(*layout), devices=devices, log=lambda s: None)
    assert t.replication["replicated_fraction"] > 0.1 and t.replication["unintended_fraction"] == 0
    lost = "sharding.rules.layers=[]" if "mesh.pipeline=2" in layout else "sharding.rules.expert=[]"
    with pytest.raises(ConfigError, match=r"% of parameter bytes are replicated where this layout means to "
                                          r"shard them.*largest: layers/"):
        Trainer(tiny_config(*layout, lost), devices=devices, log=lambda s: None)


def test_unknown_mesh_axis_in_rules():
    with pytest.raises(ConfigError, match=r"unknown mesh axis 'tensr'"):
        make_config({}, ["sharding.rules.mlp=tensr"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'; valid presets: .*1b"):
        make_config({}, ["model.preset=huge"])


def test_bad_literal_lists_valid_values():
    with pytest.raises(ConfigError, match=r"train.remat = 'everything'.*'full'"):
        make_config({}, ["train.remat=everything"])


def test_yaml_file_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: x\ntrain:\n  steps: 5\n")
    cfg = load_config(p, ["train.steps=7", "mesh.data=2"])
    assert cfg.train.steps == 7 and cfg.mesh.data == 2 and cfg.name == "x"
    # The saved resolved config loads back to the same config.
    again = tmp_path / "again.yaml"
    again.write_text(cfg.to_yaml())
    assert load_config(again) == cfg


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/x.yaml")


def test_an_override_in_the_config_files_place_is_named(capsys):
    assert main(["train", "model.preset=tiny", "train.steps=3"]) == 2
    err = capsys.readouterr().err
    assert "'model.preset=tiny' reads like an override" in err and "configs/quickstart.yaml" in err


def test_cli_prints_error_not_traceback(capsys):
    assert main(["train", "configs/quickstart.yaml", "train.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'steps'" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["../..", "a/b", "..", ".", "", "x\\y"])
def test_run_name_must_be_a_plain_file_name(name):
    with pytest.raises(ConfigError, match=r"name = .*: the run name must be a plain file name"):
        make_config({"name": name})
    assert make_config({"name": "run-1.b"}).out_dir.parts[-2:] == ("runs", "run-1.b")


def test_relative_checkpoint_dir_stays_in_the_run_dir(tmp_path):
    from jaxpar.checkpoint import checkpoint_dir
    for bad in ("../elsewhere", "a/../../b", ".."):
        with pytest.raises(ConfigError, match=rf"checkpoint.dir = {bad!r}: .*'\.\.' may not leave it"):
            make_config({}, [f"checkpoint.dir={bad}"])
    cfg = make_config({}, [f"run_dir={tmp_path}", "name=r", "checkpoint.dir=sub/ck"])
    assert checkpoint_dir(cfg) == tmp_path / "r" / "sub" / "ck"
    absolute = make_config({}, [f"run_dir={tmp_path}", "name=r", f"checkpoint.dir={tmp_path / 'abs'}"])
    assert checkpoint_dir(absolute) == tmp_path / "abs"  # the user's explicit choice


def test_unwritable_checkpoint_dir_is_one_error_before_training(tmp_path, capsys):
    rc = main(["train", "configs/quickstart.yaml", f"run_dir={tmp_path}", "checkpoint.dir=/proc/jaxpar-x"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "checkpoint.dir='/proc/jaxpar-x': cannot create or write /proc/jaxpar-x: No such file" in err, err
    assert "Traceback" not in err and not list(tmp_path.rglob("metrics.jsonl"))


def test_every_remat_policy_of_the_config_has_a_policy():
    """One list of remat policies: the config's names are exactly the policies jaxpar.nn runs."""
    from jaxpar import nn
    from jaxpar.config import REMAT_POLICIES
    assert tuple(nn.REMAT_POLICIES) == REMAT_POLICIES


def test_overrides_leave_the_callers_dict_alone():
    """make_config(raw, overrides) twice from one dict: the first call's overrides do not leak
    into the second (they were written into raw's nested dicts)."""
    raw = {"train": {"steps": 5}}
    assert make_config(raw, ["train.loss_chunk=8", "train.seq_len=32"]).train.loss_chunk == 8
    assert raw == {"train": {"steps": 5}} and make_config(raw).train.loss_chunk is None


def test_odd_head_dim_is_a_config_error():
    """dim=100 over 4 heads (head dim 25) ended in a traceback from RoPE's split inside the step."""
    with pytest.raises(ConfigError, match=r"the head dim \(dim=100 / n_heads=4 = 25\) must be even"):
        tiny_config("model.dim=100", "model.n_heads=4", "model.n_kv_heads=2")
    with pytest.raises(ConfigError, match=r"the head dim \(head_dim=9 = 9\) must be even"):
        tiny_config("model.head_dim=9")
    tiny_config("model.dim=96", "model.n_heads=4", "model.n_kv_heads=2")  # 24: fine


def test_overrides_after_a_commands_options_are_overrides(capsys):
    """`jaxpar plan CONFIG --cluster C train.compute_dtype=float16` was "unrecognized arguments":
    argparse ends a list of positionals at the first option."""
    from jaxpar.cli import parse
    args = parse(["plan", "configs/llama_1b.yaml", "--cluster", "cpu8", "train.compute_dtype=float16",
                  "mesh.data=2"])
    assert args.target == ["configs/llama_1b.yaml", "train.compute_dtype=float16", "mesh.data=2"]
    assert args.cluster == "cpu8"
    args = parse(["bench", "overhead", "--json", "train.steps=3"])
    assert (args.config, args.overrides, args.json) == (None, ["train.steps=3"], True)
    for bad in (["plan", "c.yaml", "--cluster", "cpu8", "--bogus"], ["plan", "c.yaml", "--top", "2", "stray"],
                ["generate", "runs/x", "--prompt", "x", "train.steps=3"]):  # generate takes no overrides
        with pytest.raises(SystemExit) as e:
            parse(bad)
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_profile_window_after_the_last_step_is_an_error():
    """profile.steps=[10, 12] with train.steps=4 never opened its window and wrote no trace,
    silently: it is an error naming both settings; a window that starts in time (even one that ends
    after the last step) stays valid."""
    with pytest.raises(ConfigError, match=re.escape("profile.steps=[10, 12] starts after train.steps=4")):
        make_config({}, ["train.steps=4", "profile.steps=[10,12]"])
    assert make_config({}, ["train.steps=4", "profile.steps=[4,6]"]).profile.steps == [4, 6]
    assert make_config({}, ["train.steps=4"]).profile.steps is None


def test_a_key_given_twice_in_a_yaml_file_is_an_error(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` section replaced the first whole
    (train.steps silently back to its default)."""
    p = tmp_path / "dup.yaml"
    p.write_text("train:\n  steps: 5\nmodel:\n  dim: 64\ntrain:\n  seq_len: 32\n")
    with pytest.raises(ConfigError, match=r"(?s)dup.yaml.*duplicate key .train. \(first given on line 1\).*line 5"):
        load_config(p)
    p.write_text("train:\n  steps: 5\n  steps: 6\n")
    with pytest.raises(ConfigError, match="duplicate key 'steps'"):
        load_config(p)
    # a merge key (<<) is overridden by the mapping's own keys on purpose: not a duplicate
    p.write_text("train:\n  <<: {steps: 5, seq_len: 32}\n  steps: 6\n")
    cfg = load_config(p)
    assert (cfg.train.steps, cfg.train.seq_len) == (6, 32)


def test_a_config_that_is_a_directory_or_not_text_is_one_error(tmp_path, capsys):
    """A directory was reported 'not found', a binary file a UnicodeDecodeError traceback."""
    assert main(["train", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    p = tmp_path / "c.yaml"
    text = b"train:\n  steps: 3\n"
    p.write_bytes(text + b"\xff\xfe")
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{str(p)!r} is not UTF-8 text (byte {len(text)})" in err and "Traceback" not in err


def test_compression_axes_beside_the_dcn_scope_is_one_error():
    """scope: dcn compresses the across-host part of `data` and reads no `axes`: both given,
    the axes were silently ignored."""
    with pytest.raises(ConfigError, match=r"gradient_compression.*axes=\['data'\] with scope='dcn'"):
        tiny_config("gradient_compression.method=int8", "gradient_compression.scope=dcn",
                    "gradient_compression.axes=[data]")
    tiny_config("gradient_compression.method=int8", "gradient_compression.scope=dcn")  # alone: fine


@pytest.mark.parametrize("section,key", [("train", "steps"), ("optimizer", "lr"), ("mesh", "data"),
                                         ("model", "dim")])
def test_a_boolean_for_a_number_is_refused(section, key):
    """pydantic reads `true` as 1 for a number: `train.steps: true` trained one step. Refused in
    YAML and on the command line; booleans stay booleans where the field takes them."""
    with pytest.raises(ConfigError, match=rf"{section}\.{key} = True: expected a number, got the boolean true"):
        make_config({section: {key: True}}, [])
    with pytest.raises(ConfigError, match=rf"{section}\.{key} = False: expected a number"):
        make_config({}, [f"{section}.{key}=false"])
    assert make_config({}, ["train.progress=false", "train.steps=3"]).train.steps == 3
