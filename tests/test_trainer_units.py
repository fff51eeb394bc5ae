"""In-process tests of the trainer's parts: CLI layer, 8-bit LAMB, schedule, groups, compression, backups, guard."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import List, Literal, Optional

import pytest
import torch
from hivemind.compression import BlockwiseQuantization, Float16Compression, deserialize_torch_tensor
from hivemind.compression.base import CompressionInfo

from peer.swarm.cli_args import DataclassArgumentParser, field_docs
from peer.swarm.config import CollaborationArguments, OptimizerArguments
from peer.swarm.lamb import CPULamb8Bit
from peer.swarm.optimizer import learning_rate_at, make_compression, parameter_groups
from tests.support.processes import PeerProcess, share_tensors_by_file_descriptor

# ------------------------------------------------------------------------------------------ CLI layer


@dataclass
class _Example:
    """An example config."""

    count: int = 3
    """How many."""
    ratio: float = 0.5  # a trailing comment
    # a comment above
    names: List[str] = field(default_factory=list)
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    limit: Optional[int] = None

    def __post_init__(self):
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")


def test_help_text_comes_from_docstrings_and_comments():
    docs = field_docs(_Example)
    assert docs["count"] == "How many."
    assert docs["ratio"] == "a trailing comment"
    assert docs["names"] == "a comment above"


def test_preset_then_command_line_override(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("count: 7\nratio: 0.25\nnames: [x, y]\nflag: true\nlimit: 5\n")
    parser = DataclassArgumentParser([_Example])
    (example,) = parser.parse_into_dataclasses(["--config", str(preset), "--ratio", "0.75", "--limit", "none"])
    assert (example.count, example.ratio, example.names, example.flag, example.limit) == (
        7,
        0.75,
        ["x", "y"],
        True,
        None,
    )
    (example,) = parser.parse_into_dataclasses(["--flag", "--names", "p", "q", "--mode", "b"])
    assert example.flag is True and example.names == ["p", "q"] and example.mode == "b" and example.count == 3
    (example,) = parser.parse_into_dataclasses(["--flag", "false"])
    assert example.flag is False


@pytest.mark.parametrize(
    "text,message",
    [
        ("count: 0\n", "count must be >= 1"),
        ("count: many\n", "invalid value for count"),
        ("mode: c\n", "choose from a, b"),
        ("- just a list\n", "expected a mapping"),
    ],
)
def test_bad_preset_values_exit_2(tmp_path, capsys, text, message):
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        DataclassArgumentParser([_Example]).parse_into_dataclasses(["--config", str(preset)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_collaboration_defaults_keep_request_timeout_below_matchmaking_time():
    assert CollaborationArguments(matchmaking_time=1.0).request_timeout < 1.0
    with pytest.raises(ValueError, match="must be smaller than matchmaking_time"):
        CollaborationArguments(matchmaking_time=1.0, request_timeout=2.0)


# ---------------------------------------------------------------------------------------- 8-bit LAMB


def _reference_lamb_step(param, grad, state, *, lr, betas, eps, weight_decay, clamp_value, step):
    """Textbook LAMB in float64 (bias-corrected Adam direction, decoupled decay, clamped trust ratio)."""
    beta1, beta2 = betas
    state["m"] = beta1 * state["m"] + (1 - beta1) * grad
    state["v"] = beta2 * state["v"] + (1 - beta2) * grad * grad
    update = (state["m"] / (1 - beta1**step)) / ((state["v"] / (1 - beta2**step)).sqrt() + eps)
    update = update + weight_decay * param
    trust = min(float(param.norm()), clamp_value) / float(update.norm())
    return param - lr * trust * update


@pytest.mark.parametrize("quantized", [False, True])
def test_lamb_matches_reference(quantized):
    torch.manual_seed(0)
    initial = torch.randn(64, 80)
    param = torch.nn.Parameter(initial.clone())
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, clamp_value=10.0)
    opt = CPULamb8Bit([param], min_8bit_size=1 if quantized else 10**9, max_grad_norm=None, **hyper)
    assert ("exp_avg_q" in opt.state[param]) == quantized
    reference = initial.double()
    state = dict(m=torch.zeros_like(reference), v=torch.zeros_like(reference))
    for step in range(1, 6):
        grad = torch.randn(64, 80)
        param.grad = grad.clone()
        opt.step()
        reference = _reference_lamb_step(reference, grad.double(), state, step=step, **hyper)
    error = float((param.detach().double() - reference).abs().max() / (reference - initial.double()).abs().max())
    assert error < (0.05 if quantized else 1e-4), f"relative error {error}"  # fp32 vs a float64 reference


def test_lamb_clips_the_global_gradient_norm_and_skips_non_finite():
    a, b = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(20))
    opt = CPULamb8Bit([a, b], lr=0.1, betas=(0.5, 0.9), max_grad_norm=1.0, min_8bit_size=10**9)
    a.grad, b.grad = torch.full((10,), 3.0), torch.full((20,), 4.0)
    norm = math.sqrt(10 * 9 + 20 * 16)
    opt.step()
    assert opt.last_grad_norm == pytest.approx(norm)
    # the first moment saw the clipped gradient: (1 - beta1) * grad * max_norm / norm
    assert torch.allclose(opt.state[a]["exp_avg"], torch.full((10,), 0.5 * 3.0 / norm), rtol=1e-4)
    before = [a.detach().clone(), b.detach().clone()]
    a.grad[0] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1 and opt.state[a]["step"] == 1
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


def test_lamb_trust_ratio_is_clamped():
    param = torch.nn.Parameter(torch.full((100,), 5.0))  # norm 50, clamped to 2
    opt = CPULamb8Bit([param], lr=0.1, weight_decay=0.0, clamp_value=2.0, min_8bit_size=10**9)
    param.grad = torch.randn(100)
    before = param.detach().clone()
    opt.step()
    assert float((param.detach() - before).norm()) == pytest.approx(0.1 * 2.0, rel=1e-4)


def test_lamb_state_dict_round_trip_keeps_8bit_codes():
    param = torch.nn.Parameter(torch.randn(4096))
    opt = CPULamb8Bit([param], lr=0.01, min_8bit_size=1)
    param.grad = torch.randn(4096)
    opt.step()
    other = CPULamb8Bit([torch.nn.Parameter(param.detach().clone())], lr=0.01, min_8bit_size=1)
    other.load_state_dict(opt.state_dict())
    (state,) = other.state.values()
    assert state["exp_avg_q"].dtype == torch.uint8 and state["step"] == 1
    assert torch.equal(state["exp_avg_q"], opt.state[param]["exp_avg_q"])
    # two bytes of statistics per parameter (plus one fp32 absmax per 256-element block and moment)
    assert state["exp_avg_q"].numel() + state["exp_avg_sq_q"].numel() == 2 * 4096


def test_no_decay_for_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = parameter_groups(model, weight_decay=0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


# ------------------------------------------------------------------------------------------- schedule


def test_learning_rate_schedule():
    args = OptimizerArguments(learning_rate=1.0, min_learning_rate=0.1, warmup_steps=10, total_steps=110)
    assert learning_rate_at(0, args) == pytest.approx(0.1)
    assert learning_rate_at(9, args) == pytest.approx(1.0)
    assert learning_rate_at(60, args) == pytest.approx(0.55)  # cosine half way
    assert learning_rate_at(110, args) == pytest.approx(0.1) == learning_rate_at(500, args)
    linear = OptimizerArguments(
        learning_rate=1.0, min_learning_rate=0.2, warmup_steps=0, total_steps=100, lr_schedule="linear"
    )
    assert learning_rate_at(50, linear) == pytest.approx(0.6)


# ---------------------------------------------------------------------------------------- compression


@pytest.mark.parametrize("numel,codec,bound", [(1000, Float16Compression, 1e-3), (70000, BlockwiseQuantization, 0.02)])
def test_adaptive_compression_round_trips(numel, codec, bound):
    compression = make_compression(CollaborationArguments(compression_threshold=65536))
    torch.manual_seed(0)
    tensor = torch.randn(numel)
    serialized = compression.compress(tensor, CompressionInfo.from_tensor(tensor))
    assert serialized.compression == codec.compression_type
    restored = deserialize_torch_tensor(serialized)
    assert restored.shape == tensor.shape and torch.isfinite(restored).all()
    assert float((restored - tensor).abs().mean() / tensor.abs().mean()) <= bound


# -------------------------------------------------------------------------------------------- backups


def _peer_on(run_id: str, initial_peers=(), model: Optional[torch.nn.Module] = None):
    """A DHT and a real model (a small default one) + hivemind optimizer, for in-process tests with one peer
    or several."""
    import hivemind

    from peer.swarm.network import make_validators
    from peer.swarm.optimizer import build_optimizer

    key = hivemind.utils.crypto.RSAPrivateKey()
    dht = hivemind.DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=list(initial_peers),
        record_validators=make_validators(run_id, key)[0],
    )
    model = model if model is not None else torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = build_optimizer(
        model=model,
        dht=dht,
        run_id=run_id,
        signing_key=key,
        batch_size_per_step=4,
        collab=CollaborationArguments(target_batch_size=4, matchmaking_time=1.0),
        optim=OptimizerArguments(),
        client_mode=False,
    )
    return dht, model, opt


@pytest.fixture
def solo_optimizer(tmp_path):
    """A real model + hivemind optimizer on a one-peer DHT."""
    share_tensors_by_file_descriptor()
    dht, model, opt = _peer_on("units")
    try:
        yield model, opt
    finally:
        opt.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
def test_trainer_steps_with_per_block_grad_scaling_in_fp16():
    """The trainer's per-block fp16 path with a real hivemind optimizer; CPU fp16 autocast stands in for CUDA
    (which --precision fp16 needs): blocks are unscaled before hivemind, no step is skipped, parameters move."""
    from model import LeanGPTForCausalLM, apply_memory_options
    from peer.grad_scaling import BlockScalePolicy, PerBlockGradScaler
    from peer.model_setup import Placement
    from peer.strategies import SyncTraining
    from peer.swarm.config import TrainingArguments
    from peer.swarm.data import DataArguments
    from peer.swarm.lifecycle import PeerControl
    from peer.swarm.network import NetworkArguments
    from peer.trainer import EpochStats, TrainerConfig, TrainerPeer, batch_size_per_step
    from tests.support.model import VOCAB, small_config

    share_tensors_by_file_descriptor()
    torch.manual_seed(0)
    dht, model, opt = _peer_on(
        "per_block", model=apply_memory_options(LeanGPTForCausalLM(small_config()), per_block_grad_scaling=True)
    )
    try:
        training = TrainingArguments(
            precision="fp16", per_block_grad_scaling=True, per_device_batch_size=2, gradient_accumulation_steps=2
        )
        collab = CollaborationArguments(target_batch_size=4, matchmaking_time=1.0)
        generator = torch.Generator().manual_seed(0)
        peer = TrainerPeer(
            config=TrainerConfig(NetworkArguments(), collab, OptimizerArguments(), training, DataArguments()),
            control=PeerControl(),
            dht=dht,
            public_key=b"",
            watchdog=None,
            model=model,
            placement=Placement(device=torch.device("cpu"), autocast_dtype=torch.float16),
            optimizer=opt,
            strategy=SyncTraining(opt, batch_size_per_step(training)),
            batches=iter(lambda: {"input_ids": torch.randint(0, VOCAB, (2, 16), generator=generator)}, None),
            # torch's policy (no headroom check), every step: each block's factor moves at every step
            block_scaler=PerBlockGradScaler(model, BlockScalePolicy(growth_interval=1, growth_headroom=0)),
        )
        before = [p.detach().clone() for p in model.parameters()]
        stats = EpochStats(epoch=opt.local_epoch)
        for _ in range(3):
            peer._train_step(stats)
        assert stats.steps == 3 and stats.skipped_steps == 0
        assert all(scale != 2.0**16 for scale in peer.block_scaler.scales)  # the trainer ran the scaler
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        opt.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
def test_backups_are_atomic_and_never_replaced_by_broken_ones(tmp_path, solo_optimizer):
    from peer import backup

    model, opt = solo_optimizer
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # one global epoch (target 4 = one step), parameters change
    assert opt.local_epoch == 1
    good = {k: v.clone() for k, v in model.state_dict().items()}
    assert backup.save_backup(str(tmp_path), model, opt) is not None
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert backup.save_backup(str(tmp_path), model, opt) is None  # refused: the good one stays
    assert not list(tmp_path.glob("*.tmp"))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert backup.load_backup(str(tmp_path), model, opt)
    assert all(torch.equal(good[k], v) for k, v in model.state_dict().items())
    offloaded = [p for g in opt.opt.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), offloaded)), "hivemind's copy not synced"

    (tmp_path / backup.BACKUP_NAME).write_bytes(b"truncated")
    assert not backup.load_backup(str(tmp_path), model, opt)  # ignored with a log line, no crash


@pytest.mark.timeout(120)
def test_served_state_is_a_consistent_snapshot_labelled_with_its_true_epoch(solo_optimizer):
    """hivemind bumps local_epoch before the optimizer step of that epoch runs: a joiner (or an aux checkpoint)
    that downloads in between must get the old parameters labelled with the old epoch, as copies."""
    model, opt = solo_optimizer
    averager = opt.state_averager
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert opt.local_epoch == 1
    served = {}

    def download_in_the_window():  # runs in hivemind's executor after the bump, before the optimizer step
        served["local_epoch"] = averager.local_epoch
        served["metadata"], served["tensors"], _ = averager.get_current_state()

    before = [p.detach().clone() for group in averager.optimizer.param_groups for p in group["params"]]
    model(torch.randn(4, 8)).sum().backward()
    averager._load_local_grads_into_optimizer_()
    averager.step(increment_epoch=True, optimizer_step=True, wait_for_trigger=download_in_the_window)
    after = [p for group in averager.optimizer.param_groups for p in group["params"]]

    assert served["local_epoch"] == 2 and served["metadata"]["epoch"] == 1
    assert all(torch.equal(a, b) for a, b in zip(served["tensors"], before))
    assert not any(torch.equal(a, b) for a, b in zip(before, after)), "the step changed every parameter"
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(served["tensors"], after)), "served live tensors"
    metadata, tensors, _ = averager.get_current_state()  # after the step: the new parameters, the new epoch
    assert metadata["epoch"] == 2 and all(torch.equal(a, b) for a, b in zip(tensors, after))

    opt.load_state_dict(opt.state_dict())  # a restored backup: its epoch is the parameters' epoch
    assert averager.get_current_state()[0]["epoch"] == opt.local_epoch == 2


def _served_weight(opt) -> torch.Tensor:
    return opt.state_averager.optimizer.param_groups[0]["params"][0]  # the offloaded copy that peers download


@pytest.mark.timeout(180)
def test_states_with_nan_values_are_neither_served_nor_applied(monkeypatch):
    """A recovering peer does not share its NaN parameters; a NaN state from a faulty peer is not applied."""
    share_tensors_by_file_descriptor()
    from hivemind.optim.state_averager import TrainingStateAverager

    from peer.swarm.hivemind_seam import LeanHiveStateAverager

    dht_a, _, opt_a = _peer_on("nan-state")
    dht_b, model_b, opt_b = _peer_on("nan-state", dht_a.get_visible_maddrs())
    with torch.no_grad():
        _served_weight(opt_a).fill_(1.0)
        model_b[0].weight.fill_(2.0)
        _served_weight(opt_b).fill_(2.0)
    peers = [(dht_a, opt_a), (dht_b, opt_b)]
    try:
        with torch.no_grad():
            _served_weight(opt_a)[0, 0] = float("nan")
        assert not opt_b.load_state_checked(), "a peer with NaN parameters served them"
        assert torch.all(model_b[0].weight == 2.0)

        with torch.no_grad():
            _served_weight(opt_a)[0, 0] = 1.0  # recovered: it shares again
        assert opt_b.load_state_checked() and torch.all(model_b[0].weight == 1.0)

        opt_a.shutdown()
        dht_a.shutdown()
        peers.pop(0)
        # a faulty peer serves its state unchecked (hivemind's own serving code); the WeakMethod that serves
        # the state binds the class's function when the averager is built, so the patch only affects this one
        monkeypatch.setattr(LeanHiveStateAverager, "get_current_state", TrainingStateAverager.get_current_state)
        dht_c, _, opt_c = _peer_on("nan-state", dht_b.get_visible_maddrs())
        monkeypatch.undo()
        peers.append((dht_c, opt_c))
        with torch.no_grad():
            _served_weight(opt_c)[0, 0] = float("inf")
        assert not opt_b.load_state_checked(), "a state with inf values was applied"
        assert torch.all(torch.isfinite(model_b[0].weight)) and torch.all(model_b[0].weight == 1.0)
    finally:
        for dht, opt in peers:
            opt.shutdown()
            dht.shutdown()


# ---------------------------------------------------------------------------------------- process guard

_GUARDED = textwrap.dedent("""
    import multiprocessing as mp, subprocess, sys, time
    from peer.swarm import process_guard

    def child():
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("grandchild", grandchild.pid, flush=True)
        time.sleep(120)

    if __name__ == "__main__":
        process_guard.install()
        mp.set_start_method("fork")
        proc = mp.Process(target=child, daemon=True)
        proc.start()
        print("child", proc.pid, flush=True)
        time.sleep(120)
""")


@pytest.mark.timeout(60)
def test_children_die_with_a_sigkilled_parent(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    peer = PeerProcess([], script=str(script), name="guarded", log_path=tmp_path / "guarded.log")
    peer.start()
    peer.wait_for(r"grandchild \d+", timeout=30)
    assert len(peer.snapshot_tree()) == 3
    peer.kill()
    assert not peer.wait_until_gone(timeout=10)


_STUCK_PEER = textwrap.dedent("""
    import logging, sys, threading
    import peer.swarm.lifecycle as cli

    class StuckPeer:  # its step never ends by itself, like an all-reduce waiting out a long averaging_timeout
        @classmethod
        def build(cls, control, parts):
            parts.callback(print, "backup written", flush=True)
            return cls()
        def run(self):
            print("running", flush=True)
            threading.Event().wait()

    logging.basicConfig(level=logging.INFO)
    cli.STOP_GRACE_SECONDS = float(sys.argv[1])
    cli.run_peer(StuckPeer.build)
""")


@pytest.mark.timeout(60)
def test_a_stop_signal_interrupts_a_step_that_overruns_the_grace_period(tmp_path):
    import signal
    import time

    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_PEER)
    peer = PeerProcess(["2"], script=str(script), name="stuck", log_path=tmp_path / "stuck.log").start()
    peer.wait_for("running", timeout=30)
    started = time.monotonic()
    assert peer.stop(signal.SIGTERM, timeout=20) == 0
    assert 1.5 < time.monotonic() - started < 10
    log = peer.log()
    assert "interrupting it" in log and "Interrupted: leaving" in log and "backup written" in log


_SWALLOWING_PEER = textwrap.dedent("""
    import functools, logging, sys, threading
    import peer.swarm.lifecycle as cli

    class SwallowingPeer:  # the stop-now KeyboardInterrupt lands where Python only prints it, like an at-fork hook
        def __init__(self, control):
            self.control = control
        @classmethod
        def build(cls, after, control, parts):
            parts.callback(print, "backup written", flush=True)
            print("joining", flush=True)
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                print("interrupt swallowed", flush=True)
            if after == "stuck":  # still joining: only a second interrupt gets it out
                threading.Event().wait()
            return cls(control)
        def run(self):
            print("run entered, stop requested:", self.control.stop_requested.is_set(), flush=True)

    logging.basicConfig(level=logging.INFO)
    cli.STOP_RETRY_SECONDS = 1.0
    cli.run_peer(functools.partial(SwallowingPeer.build, sys.argv[1]))
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("after", ["returns", "stuck"])
def test_a_stop_signal_lost_while_joining_still_stops_the_peer(after, tmp_path):
    """A lost interrupt is remembered (the run loop sees the request) and raised again until it takes effect."""
    import signal

    script = tmp_path / "swallowing.py"
    script.write_text(_SWALLOWING_PEER)
    peer = PeerProcess([after], script=str(script), name="swallowing", log_path=tmp_path / "swallowing.log").start()
    peer.wait_for("joining", timeout=30)
    assert peer.stop(signal.SIGTERM, timeout=20) == 0
    log = peer.log()
    assert "interrupt swallowed" in log and "backup written" in log
    if after == "returns":
        assert "run entered, stop requested: True" in log
    else:
        assert "raising it again" in log and "Interrupted: leaving" in log and "run entered" not in log


def test_debug_loggers_env_turns_on_debug_for_the_named_loggers_only(monkeypatch):
    import logging

    from peer.swarm.lifecycle import DEBUG_LOGGERS_ENV, configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    named = [logging.getLogger(name) for name in ("hivemind.averaging.matchmaking", "leanhive.test.debug")]
    monkeypatch.setenv(DEBUG_LOGGERS_ENV, "hivemind.averaging.matchmaking, leanhive.test.debug,")
    try:
        configure_logging()
        assert all(logger.isEnabledFor(logging.DEBUG) for logger in named)
        assert not logging.getLogger("hivemind.dht").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("peer.trainer").isEnabledFor(logging.DEBUG)
    finally:
        root.handlers[:], root.level = saved
        for logger in named:
            logger.setLevel(logging.NOTSET)
