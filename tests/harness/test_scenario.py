"""Scenario files: tail and routing runs parse with their own keys; every defect names file, run and key."""

from __future__ import annotations

import pytest

from musebench.harness.scenario import RoutingScenarioRun, ScenarioError, ScenarioRun, load_scenario


def _load(tmp_path, text: str):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return load_scenario(path)


def test_a_routing_run_takes_its_keys(tmp_path):
    (run,) = _load(tmp_path, """
[[run]]
name = "r"
kernel = "routing"
tp = [2, 4, 8]
tokens = [1, 8]
tile = [8, 128]
renormalize = [true, false]
inputs = ["random", "adversarial"]
seeds = [0, 1]
backend = "cute"
""")
    assert run == RoutingScenarioRun(source=str(tmp_path / "s.toml"), name="r", kernel="routing", tp=(2, 4, 8),
                                     tokens=(1, 8), tile=(8, 128), renormalize=(True, False),
                                     inputs=("random", "adversarial"), seeds=(0, 1), backend="cute")


def test_a_bare_routing_run_gets_musebench_routing_defaults(tmp_path):
    (run,) = _load(tmp_path, '[[run]]\nkernel = "routing"\nrenormalize = false\n')
    assert (run.tp, run.tokens, run.tile, run.renormalize) == ((8,), tuple(range(1, 9)), (8,), (False,))
    assert (run.inputs, run.seeds, run.backend, run.name) == (("random", "adversarial"), (0,), "auto", "run 1")


def test_defaults_serve_both_kinds_and_each_run_takes_its_own(tmp_path):
    tail, routing = _load(tmp_path, """
[defaults]
modes = ["ep"]
weights = ["bf16"]
launcher = "torchrun"
tile = [64]
seeds = [3]
[[run]]
tp = [2]
[[run]]
kernel = "routing"
tp = [4]
""")
    assert isinstance(tail, ScenarioRun) and tail.modes == ("ep",) and tail.launcher == "torchrun"
    assert tail.seeds == (3,)
    assert isinstance(routing, RoutingScenarioRun) and routing.tile == (64,) and routing.seeds == (3,)


def test_defaults_kernel_routing_makes_every_run_routing(tmp_path):
    (run,) = _load(tmp_path, '[defaults]\nkernel = "routing"\n[[run]]\ntp = 2\n')
    assert isinstance(run, RoutingScenarioRun) and run.tp == (2,)


@pytest.mark.parametrize(
    "run_text, message",
    [
        # a tail key in a routing run, and a routing key in a tail run
        ('kernel = "routing"\nweights = ["bf16"]', "run 1: key 'weights' belongs to tail runs"),
        ('kernel = "routing"\nlauncher = "torchrun"', "run 1: key 'launcher' belongs to tail runs"),
        ('kernel = "routing"\ncapacity = 8', "run 1: key 'capacity' belongs to tail runs"),
        ('tile = [8]', "run 1: key 'tile' belongs to routing runs"),
        ('kernel = "tail"\nrenormalize = true', "run 1: key 'renormalize' belongs to routing runs"),
        # routing values out of range or of the wrong type
        ('kernel = "routing"\ntile = [0]', "run 1: tile must be in 1..256, got [0]"),
        ('kernel = "routing"\ntile = [257]', "tile must be in 1..256, got [257]"),
        ('kernel = "routing"\ntokens = [9]', "run 1: tokens must be in 1..8"),
        ('kernel = "routing"\ntp = [1]', "run 1: tp must be in 2..32, got 1"),
        ('kernel = "routing"\nrenormalize = [1]', "run 1: renormalize must hold bool values, got 1"),
        ('kernel = "routing"\ntile = [true]', "run 1: tile must hold int values, got True"),
        ('kernel = "routing"\ntile = []', "run 1: tile is empty"),
        ('kernel = "routing"\ninputs = ["zeros"]', "run 1: inputs value 'zeros' is not one of random, adversarial"),
        ('kernel = "routing"\nbackend = "triton"', "run 1: backend 'triton' is not one of auto, cpu, cute"),
        ('kernel = "attention"', "run 1: kernel 'attention' is not one of tail, routing"),
        ('kernel = "routing"\ncolour = "red"', "run 1: unknown key 'colour'"),
        ('ep_launch = "three"', "run 1: ep_launch 'three' is not one of two, single"),
        ('kernel = "routing"\nep_launch = "single"', "run 1: key 'ep_launch' belongs to tail runs"),
        # a removed option: the reason, not "unknown key"
        ('stock = "flashinfer"', "run 1: key 'stock' was removed: runs are checked against musebench's bitwise "
                                 "references (stock/) only"),
        ('transport = "nvls"', "run 1: transport 'nvls' is not one of auto, local, ipc, unicast, multicast"),
    ],
)
def test_defects_name_file_run_and_key(tmp_path, run_text, message):
    with pytest.raises(ScenarioError) as error:
        _load(tmp_path, f"[[run]]\n{run_text}\n")
    assert str(error.value).startswith(str(tmp_path / "s.toml"))
    assert message in str(error.value)


def test_a_removed_default_is_refused_with_its_reason(tmp_path):
    with pytest.raises(ScenarioError, match=r"\[defaults\]: key 'stock' was removed: .*SM100 with NVLink multicast"):
        _load(tmp_path, '[defaults]\nstock = "reference"\n[[run]]\ntp = [2]\n')


def test_a_bad_default_is_refused_even_when_no_run_takes_it(tmp_path):
    with pytest.raises(ScenarioError, match=r"\[defaults\]: tile must hold int values"):
        _load(tmp_path, '[defaults]\ntile = ["wide"]\n[[run]]\ntp = [2]\n')


def test_the_projects_scenario_files_load():
    parity = load_scenario("scenarios/parity.toml")
    (routing,) = [run for run in parity if isinstance(run, RoutingScenarioRun)]
    assert routing.tp == (2, 4, 8) and routing.tokens == tuple(range(1, 9)) and routing.renormalize == (True, False)
    assert routing.inputs == ("random", "adversarial") and len(routing.seeds) >= 2 and routing.backend == "auto"
    nightly = load_scenario("scenarios/gb200-nightly.toml")
    assert any(isinstance(run, RoutingScenarioRun) for run in nightly)
    assert all(isinstance(run, ScenarioRun) for run in load_scenario("scenarios/gpu-ep.toml"))


def test_a_tail_run_picks_its_ep_launch(tmp_path):
    two, single = _load(tmp_path, '[[run]]\ntp = [2]\n[[run]]\ntp = [2]\nep_launch = "single"\n')
    assert (two.ep_launch, single.ep_launch) == ("two", "single")


def test_a_routing_run_refuses_the_tail_only_edge_family(tmp_path):
    with pytest.raises(ScenarioError, match="routing inputs"):
        _load(tmp_path, '[[run]]\nkernel = "routing"\ninputs = ["random", "edge"]\n')
    (run,) = _load(tmp_path, '[[run]]\ninputs = ["edge"]\n')  # a tail run takes it
    assert run.inputs == ("edge",)
