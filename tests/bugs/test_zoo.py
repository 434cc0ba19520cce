"""The bug registry (``tpattn.bugs.zoo``): every entry runs on simulated ranks in both ``simulate``
semantics, fails ``equivalence``, and shows the signature its report describes.

Tolerances: ``TOLERANCE`` (1e-6 absolute) between two float32 computations of the same numbers
at the seed's size (rounding ~1e-7); relations such as "the norm gradient is W times the
dense one" are checked to 1e-5 relative (float32 rounding of the same sums, ~1e-7 relative,
with a wide margin), and bug effects are >= 1e-5 absolute, at least 10x the tolerance.
"""
import json

import pytest
import torch

import tpattn
from tpattn import MEASURES, TOLERANCE, Config
from tpattn.bugs import zoo
from tpattn.block.params import shard_params
from tpattn.check.core import LR, five_measures, fixture_step, make_inputs
from tpattn.parallel.simulated import simulated_step
from tpattn.cli import main as cli_main

CFG = Config()
CFG_KV4 = Config(query_heads=8, kv_heads=4)             # 2 KV heads per rank
CFG_W4 = Config(query_heads=8, kv_heads=4, world_size=4)
SEEDS = (11, 29)


def config_for(mode: str) -> Config:
    """The seed's shape, or the smallest one that meets the mode's needs."""
    return CFG_KV4 if mode == "repeat_kv_tiled" else CFG


BUGS = [m for m in zoo.runnable_modes() if m != tpattn.EQUIVALENCE]


def test_every_entry_has_a_fidelity_and_a_citation_iff_it_has_a_report():
    listed = {m["name"]: m for m in zoo.list_modes()}
    for m in listed.values():
        assert set(m) == {"name", "description", "citation", "fidelity", "fidelity_note",
                          "needs", "provider", "runnable", "observable"}
        assert m["fidelity"] in zoo.FIDELITIES, m
        assert bool(m["citation"]) == (m["fidelity"] in ("mechanism", "consistent")), m
        assert m["fidelity_note"] and "\n" not in m["fidelity_note"], m
        assert m["runnable"] is True, m  # every mode runs in tpattn.run
    assert [n for n, m in listed.items() if m["fidelity"] == "correct"] == [tpattn.EQUIVALENCE]
    # the counted "reported bugs" are the mechanism entries only
    assert zoo.reported_modes() == tuple(n for n, m in listed.items()
                                         if m["fidelity"] == "mechanism")
    # the corrections of issue 23: what the cited threads actually show
    assert listed["input_grad_reduce_averaged"]["fidelity"] == "no report"
    assert "norm_grad_averaged" in listed["input_grad_reduce_averaged"]["fidelity_note"]
    assert listed["output_reduced_twice"]["fidelity"] == "no report"
    assert listed["input_grad_reduced_twice"]["fidelity"] == "consistent"
    assert "FP8" in listed["input_grad_reduced_twice"]["fidelity_note"]
    assert listed["inputs_not_replicated"]["fidelity"] == "consistent"
    assert "Megatron-DeepSpeed" not in listed["inputs_not_replicated"]["citation"]
    assert "Dropout" in listed["inputs_not_replicated"]["fidelity_note"]
    assert "independent of TP" in listed["repeat_kv_tiled"]["fidelity_note"]
    assert "gpt-neox PR 1259" in listed["norm_grad_averaged"]["citation"]
    # the corrections of issue 35
    assert listed["missing_input_grad_reduce"]["fidelity"] == "mechanism"
    assert "bigcode-project/Megatron-LM PR 36" in listed["missing_input_grad_reduce"]["citation"]
    assert "PR 6839" in listed["missing_input_grad_reduce"]["citation"]
    assert listed["missing_kv_grad_reduce"]["fidelity"] == "mechanism"
    assert "issue 11" in listed["missing_kv_grad_reduce"]["citation"]
    assert listed["loss_reduced_over_world"]["fidelity"] == "no report"
    assert "PR 105" in listed["loss_reduced_over_world"]["fidelity_note"]
    assert "mcore-bridge PR 101" in listed["input_grad_reduced_twice"]["citation"]
    assert "not a TP report" in listed["repeat_kv_tiled"]["fidelity_note"]
    assert "CPU generator" in listed["dropout_rng_desync"]["description"]
    assert "CUDA generator" in listed["dropout_rng_desync"]["fidelity_note"]
    assert "TP + CP" in listed["loss_full_tensor_tp_only"]["fidelity_note"]
    # the modes of the sequence-parallel and KV-replication work: injections that need their
    # layout, observable there, not among the plain-TP shapes' runnable_modes()
    for name, need in [("missing_norm_grad_reduce", "sequence_parallel"),
                       ("norm_grad_averaged", "sequence_parallel"),
                       ("missing_kv_grad_reduce", "kv_heads < world_size")]:
        assert need in listed[name]["needs"] and need in zoo.LAYOUT_NEEDS
        assert listed[name]["provider"] != "tpattn.bugs.zoo"
        assert zoo.REGISTRY[name].injection.reduction_only  # the seed's check runs it
        assert listed[name]["observable"] is True and name not in zoo.runnable_modes()
    assert all(m["observable"] for m in listed.values())


def test_the_layout_modes_run_through_the_registry_and_on_the_engines_ranks():
    sp = tpattn.Config(seq=8, sequence_parallel=True)
    kv = tpattn.Config(query_heads=8, kv_heads=2, world_size=4)
    for mode, cfg in [("missing_norm_grad_reduce", sp), ("norm_grad_averaged", sp),
                      ("missing_kv_grad_reduce", kv), ("equivalence", sp), ("equivalence", kv)]:
        assert tpattn.run(11, mode, cfg)["passed"] is (mode == "equivalence")
        # the zoo's sides on the engine's ranks are tpattn.run's two sides, bit for bit
        dense, tp, _ = zoo.sides(mode, 11, cfg, "ranks")
        assert five_measures(11, mode, dense, tp) == tpattn.run(11, mode, cfg, "ranks")
        # and in the fixture's one-graph view (the engine on OneGraphRanks) too
        dense, tp, _ = zoo.sides(mode, 11, cfg, "fixture")
        assert five_measures(11, mode, dense, tp) == tpattn.run(11, mode, cfg)
    # on a shape the mode does not apply to, the rule that fails is named
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        tpattn.observe("norm_grad_averaged", 11)
    with pytest.raises(ValueError, match="needs replicated KV heads"):
        zoo.resolve("missing_kv_grad_reduce", tpattn.Config(), strict=True)


def test_a_mode_of_the_zoos_block_refuses_a_shape_the_block_does_not_have():
    """The zoo's block is plain TP: under sequence parallelism it would silently observe
    plain TP, and with replicated KV heads it used to crash in einsum."""
    sp = tpattn.Config(seq=8, sequence_parallel=True)
    kv = tpattn.Config(query_heads=8, kv_heads=2, world_size=4)
    for mode in ("input_grad_reduced_twice", "row_bias_on_every_rank"):
        with pytest.raises(ValueError, match="no sequence parallelism: sequence_parallel"):
            tpattn.observe(mode, 11, sp)
        with pytest.raises(ValueError, match="kv_heads must be >= world_size .*kv_heads=2"):
            tpattn.observe(mode, 11, kv)
    with pytest.raises(ValueError, match="no sequence parallelism"):
        tpattn.run(11, "row_bias_on_every_rank", sp)
    # tpattn.run still computes its own modes on those shapes
    assert tpattn.run(11, "equivalence", sp)["passed"] is True
    assert tpattn.run(11, "equivalence", kv)["passed"] is True


def test_cli_diagnose_of_a_layout_mode_diagnoses_and_an_unmet_need_exits_2(capsys):
    argv = ["--mode", "norm_grad_averaged", "--sequence-parallel", "--seq", "8",
            "--diagnose", "--simulate", "ranks"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "norm_grad_averaged" and out["passed"] is False
    assert out["diagnosis"] and all("cause" in c for c in out["diagnosis"])
    with pytest.raises(SystemExit) as e:
        cli_main(["--mode", "norm_grad_averaged", "--diagnose"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs sequence_parallel=True" in err[0]


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
@pytest.mark.parametrize("mode", BUGS)
def test_every_bug_fails_equivalence(mode, simulate):
    for seed in SEEDS:
        result = tpattn.run(seed, mode, config_for(mode), simulate=simulate)
        assert result["mode"] == mode and result["passed"] is False
        assert max(result[m] for m in MEASURES) > 10 * TOLERANCE


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
@pytest.mark.parametrize("mode", tpattn.MODES)
def test_the_zoo_block_is_the_packages_block_on_the_seeds_modes(mode, simulate):
    """The engine's block wired as the registry's injections of the seed's three modes (in
    the fixture's view on OneGraphRanks, not the seed's tp_forward) gives check.run's numbers
    (both semantics)."""
    inj = zoo.resolve(mode).injection
    for cfg in (CFG, CFG_W4):
        for seed in SEEDS:
            x0, target = make_inputs(cfg, seed)
            base = zoo.make_params(cfg, seed, inj)
            engine = fixture_step(x0, target, base, cfg, inj, shard_params) \
                if simulate == "fixture" else zoo.tp_side(seed, cfg, inj, "ranks")
            ours = five_measures(seed, mode, zoo.dense_step(x0, target, base, cfg, inj), engine)
            seeds = tpattn.run(seed, mode, cfg, simulate=simulate)
            assert ours["passed"] is seeds["passed"]
            for m in MEASURES:
                assert abs(ours[m] - seeds[m]) <= TOLERANCE, (m, ours[m], seeds[m])


def _sides(mode, seed=11, cfg=CFG, simulate="ranks"):
    inj = zoo.resolve(mode).injection
    x0, target = make_inputs(cfg, seed)
    base = zoo.make_params(cfg, seed, inj)
    return zoo.dense_step(x0, target, base, cfg, inj), zoo.tp_side(seed, cfg, inj, simulate), base


def _close(a, b, rel=1e-5):
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
@pytest.mark.parametrize("cfg", [CFG, CFG_W4], ids=["W2", "W4"])
def test_f_averaged_and_f_twice_scale_the_norm_gradient_by_one_over_w_and_w(cfg, simulate):
    w = cfg.world_size
    for mode, factor in [("input_grad_reduce_averaged", 1 / w), ("input_grad_reduced_twice", w)]:
        dense, tp, _ = _sides(mode, cfg=cfg, simulate=simulate)
        assert _close(tp["grads"]["norm"], factor * dense["grads"]["norm"])
        for name in ("wq", "wk", "wv", "wo"):  # shard gradients never see the missing sum
            assert (tp["grads"][name] - dense["grads"][name]).abs().max() <= TOLERANCE
        assert (tp["output"] - dense["output"]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("cfg", [CFG, CFG_W4], ids=["W2", "W4"])
def test_g_twice_multiplies_the_attention_output_by_w(cfg):
    dense, tp, _ = _sides("output_reduced_twice", cfg=cfg)
    x0, _ = make_inputs(cfg, 11)
    assert _close(tp["output"] - x0, cfg.world_size * (dense["output"] - x0))


@pytest.mark.parametrize("simulate", ["fixture", "ranks"])
@pytest.mark.parametrize("cfg", [CFG, CFG_W4], ids=["W2", "W4"])
def test_row_bias_on_every_rank_is_off_by_exactly_w_minus_one_biases(cfg, simulate):
    dense, tp, base = _sides("row_bias_on_every_rank", cfg=cfg, simulate=simulate)
    extra = (cfg.world_size - 1) * base["bias"]
    assert ((tp["output"] - dense["output"]) - extra).abs().max() <= TOLERANCE
    assert extra.abs().max() > 100 * TOLERANCE


def test_the_bias_comes_from_its_own_generator_and_leaves_the_seeds_parameters_alone():
    with_bias = zoo.make_params(CFG, 11, zoo.Injection(bias="after_g"))
    seeds = tpattn.init_params(CFG, 11 + tpattn.check.core.PARAM_SEED_OFFSET)
    assert list(with_bias) == list(seeds) + ["bias"]
    for k in seeds:
        assert torch.equal(with_bias[k], seeds[k])


@pytest.mark.parametrize("cfg", [CFG, CFG_W4], ids=["W2", "W4"])
def test_a_naive_fused_split_hands_rank_0_only_query_rows(cfg):
    base = zoo.make_params(cfg, 11, zoo.Injection())
    rank0 = zoo.shard(base, cfg, zoo.Injection(shard="fused_naive"))[0]
    q_rows = base["wq"]
    for name in ("wq", "wk", "wv"):  # every row rank 0 holds is a row of Wq
        for row in rank0[name]:
            assert any(torch.equal(row, r) for r in q_rows)
    # and the fused layout round-trips
    back = zoo.unshard(zoo.shard(base, cfg, zoo.Injection(shard="fused_naive")), cfg,
                       zoo.Injection(shard="fused_naive"))
    for k in tpattn.block.params.PARAM_NAMES:
        assert torch.equal(back[k], base[k])


def test_counting_replicas_in_the_grad_norm_changes_only_the_step():
    result = tpattn.run(11, "grad_norm_counts_replicas", simulate="ranks")
    failing = [m for m in MEASURES if result[m] >= TOLERANCE]
    assert failing == ["post_step_weight_max_abs_diff"], result
    # the logged norm: each rank adds the replicated norm's squared gradient
    inj = zoo.resolve("grad_norm_counts_replicas").injection
    base = zoo.make_params(CFG, 11, inj)
    shards = [{k: t.detach() for k, t in s.items()} for s in zoo.shard(base, CFG, inj)]
    batches = zoo.rank_batches(CFG, 11, inj)
    bug = simulated_step(shards, batches, CFG, inj, LR)
    good = simulated_step(shards, batches, CFG, inj.correct(), LR)
    norm_grad = bug["grads"]["norm"][0].double().pow(2).sum().item()
    expected = good["grad_norm"] ** 2 + (CFG.world_size - 1) * norm_grad
    assert bug["grad_norm"] ** 2 == pytest.approx(expected, rel=1e-9)
    assert bug["grad_norm"] > good["grad_norm"] > zoo.MAX_GRAD_NORM


def test_tiled_repeat_kv_hides_when_each_rank_holds_one_kv_head():
    """At the seed's shape (one KV head per rank) tiling and interleaving are the same
    operation, so the bug cannot show: the registry refuses that shape, and the injection
    there passes."""
    with pytest.raises(ValueError, match="needs kv_heads >= 2 \\* world_size"):
        tpattn.run(11, "repeat_kv_tiled")
    x0, target = make_inputs(CFG, 11)
    base = zoo.make_params(CFG, 11, zoo.Injection())
    tp = zoo.tp_side(11, CFG, zoo.Injection(kv="tile"), "ranks")
    dense = zoo.dense_step(x0, target, base, CFG, zoo.Injection())
    assert tpattn.check.core.five_measures(11, "x", dense, tp)["passed"]


def test_inputs_not_replicated_gives_every_rank_its_own_loss():
    inj = zoo.resolve("inputs_not_replicated").injection
    base = zoo.make_params(CFG_W4, 11, inj)
    shards = [{k: t.detach() for k, t in s.items()} for s in zoo.shard(base, CFG_W4, inj)]
    step = simulated_step(shards, zoo.rank_batches(CFG_W4, 11, inj), CFG_W4, inj, LR)
    losses = [float(l) for l in step["losses"]]
    assert len(set(losses)) == CFG_W4.world_size, losses


def test_the_ledger_counts_each_collective_where_it_runs():
    inj = zoo.resolve("input_grad_reduced_twice").injection
    base = zoo.make_params(CFG, 11, inj)
    shards = [{k: t.detach() for k, t in s.items()} for s in zoo.shard(base, CFG, inj)]
    step = simulated_step(shards, zoo.rank_batches(CFG, 11, inj), CFG, inj, LR)
    phases = [e["phase"] for e in step["ledger"]]
    assert phases == ["forward", "backward", "backward", "step"]


# --- validation and the CLI ----------------------------------------------------------------

def test_modes_other_modules_provide_run_in_check_run():
    kv = tpattn.Config(query_heads=8, kv_heads=2, world_size=4)
    assert tpattn.run(11, "missing_kv_grad_reduce", kv)["passed"] is False
    sp = tpattn.Config(seq=8, sequence_parallel=True)
    assert tpattn.run(11, "missing_norm_grad_reduce", sp)["passed"] is False
    with pytest.raises(ValueError, match="needs replicated KV heads"):
        tpattn.run(11, "missing_kv_grad_reduce")
    with pytest.raises(ValueError, match="mode must be one of .* registry mode"):
        tpattn.run(11, "nope")


def test_resolve_looks_every_mode_up_once_and_its_injection_says_how_it_runs():
    from tpattn.bugs.modes import resolve
    from tpattn.check.core import ALL_MODES

    assert resolve("equivalence") is zoo.REGISTRY["equivalence"]
    assert resolve("equivalence").injection == zoo.Injection()
    sp = tpattn.Config(seq=8, sequence_parallel=True)
    assert resolve("missing_norm_grad_reduce", sp).injection.reduction_only
    # the seed's check's modes are exactly the registry's reduction-only injections
    assert [n for n, m in zoo.REGISTRY.items() if m.injection.reduction_only] == list(ALL_MODES)
    # and correct TP is the one entry whose program is its own bug-free twin
    assert [n for n, m in zoo.REGISTRY.items() if m.is_correct] == ["equivalence"]
    assert not zoo.Injection(bias="every_rank").reduction_only  # a setup change is no reduction
    assert not zoo.Injection(g=2).reduction_only and zoo.Injection(f="none", g=0).reduction_only
    bugs = [m for m in zoo.runnable_modes() if not resolve(m).injection.reduction_only]
    assert len(bugs) == len(zoo.runnable_modes()) - len(tpattn.MODES)
    with pytest.raises(ValueError, match="needs replicated KV heads"):  # validated first
        resolve("missing_kv_grad_reduce", tpattn.Config())
    with pytest.raises(ValueError, match="mode must be one of .* registry mode"):
        resolve("nope")
    # at world size 1 the original fixture's modes run (no bug to see); strict asks every need
    ws1 = tpattn.Config(world_size=1)
    assert resolve("missing_output_reduce", ws1) is zoo.REGISTRY["missing_output_reduce"]
    with pytest.raises(ValueError, match="'missing_output_reduce' needs world_size >= 2"):
        resolve("missing_output_reduce", ws1, strict=True)
    with pytest.raises(ValueError, match="'output_reduced_twice' needs world_size >= 2"):
        resolve("output_reduced_twice", ws1)
    assert zoo.resolve("norm_grad_averaged").name == "norm_grad_averaged"  # name only


def test_register_adds_a_runnable_mode_and_refuses_to_steal_a_name():
    """A contributed mode runs through its injection (here a made-up bug: every partial
    doubled before g); one without an injection is listed but not runnable."""
    entry = zoo.BugMode("test_only_mode", "a test's mode", None, provider="tests",
                        injection=zoo.Injection(partial_scale=2.0))
    listed = zoo.BugMode("test_listed_mode", "listed only", None, provider="tests")
    with pytest.raises(ValueError, match="fidelity must be one of"):
        zoo.register(zoo.BugMode("test_only_mode", "x", None, fidelity="reported"))
    with pytest.raises(ValueError, match="citation must be given iff"):
        zoo.register(zoo.BugMode("test_only_mode", "x", "a/b issue 1"))
    assert "test_only_mode" not in zoo.REGISTRY
    try:
        zoo.register(entry)
        zoo.register(listed)
        assert "test_only_mode" in zoo.runnable_modes()
        assert "test_listed_mode" not in zoo.runnable_modes()
        for simulate in ("fixture", "ranks"):
            row = tpattn.run(5, "test_only_mode", simulate=simulate)
            assert row["mode"] == "test_only_mode" and row["passed"] is False
            assert row["forward_max_abs_diff"] > 1e-3
        watched = tpattn.observe("test_only_mode", 5)  # the doubled partials show in the losses
        assert watched["rank_losses"] != tpattn.observe("equivalence", 5)["rank_losses"]
        assert [m["runnable"] for m in zoo.list_modes()[-2:]] == [True, False]
        with pytest.raises(ValueError, match="has no injection of this block: tests"):
            tpattn.run(5, "test_listed_mode")
        with pytest.raises(ValueError, match="already registered"):
            zoo.register(zoo.BugMode("row_bias_on_every_rank", "x", None, provider="other"))
    finally:
        zoo.REGISTRY.pop("test_only_mode", None)
        zoo.REGISTRY.pop("test_listed_mode", None)


def test_cli_lists_the_modes(capsys):
    assert cli_main(["--list-modes"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in listed] == list(zoo.mode_names())
    assert all(m["runnable"] is True and m["fidelity"] in zoo.FIDELITIES for m in listed)
    assert [m["name"] for m in listed if m["fidelity"] == "mechanism"] \
        == list(zoo.reported_modes())


@pytest.mark.parametrize("mode", BUGS)
def test_every_bug_is_a_cli_mode(mode, capsys):
    cfg = config_for(mode)
    flags = ["--query-heads", str(cfg.query_heads), "--kv-heads", str(cfg.kv_heads)]
    assert cli_main(["--mode", mode, "--simulate", "ranks"] + flags) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == mode and out["passed"] is False
    assert out == tpattn.run(11, mode, cfg, simulate="ranks")


def test_cli_unmet_need_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--mode", "repeat_kv_tiled"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs kv_heads >= 2 * world_size" in err


# --- real ranks ---------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [CFG_KV4, CFG_W4], ids=["2 ranks", "4 ranks"])
def test_real_ranks_equal_simulated_ranks_for_every_bug(cfg):
    """One process group per shape runs every bug; each result equals simulate="ranks"
    within TOLERANCE (in practice to the bit: the same float32 operations in the same order)."""
    from tpattn.real.ranks import run_distributed

    modes = [m for m in BUGS if not (m == "repeat_kv_tiled" and cfg.kv_heads < 2 * cfg.world_size)]
    report = run_distributed(cfg.world_size, seeds=[11], modes=modes, config=cfg, dtensor=False)
    assert [r["mode"] for r in report.results] == modes
    for real in report.results:
        simulated = tpattn.run(real["seed"], real["mode"], cfg, simulate="ranks")
        assert real["passed"] is simulated["passed"] is False
        for m in MEASURES:
            assert abs(real[m] - simulated[m]) <= TOLERANCE, (real["mode"], m)
    counts = {row["mode"]: (row["forward_actual"], row["backward_actual"]) for row in report.ledger}
    assert counts["output_reduced_twice"] == (2, 1) and counts["input_grad_reduced_twice"] == (1, 2)


def test_the_distributed_cli_runs_a_registry_mode(capsys):
    from tpattn.cli import modes_listing
    from tpattn.distributed import distributed_main

    assert distributed_main(["--mode", "row_bias_on_every_rank"]) == 0
    real = json.loads(capsys.readouterr().out)
    assert real == pytest.approx(tpattn.run(11, "row_bias_on_every_rank", simulate="ranks"),
                                 abs=TOLERANCE)
    assert distributed_main(["--list-modes"]) == 0
    assert json.loads(capsys.readouterr().out) == modes_listing()
    with pytest.raises(SystemExit) as e:
        distributed_main(["--mode", "nope"])
    assert e.value.code == 2
