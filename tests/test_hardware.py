"""Precision and threads chosen by the machine (lapheads.hardware)."""

from __future__ import annotations

import pytest
import torch

from lapheads import hardware


@pytest.fixture
def cpu(monkeypatch):
    def make(native: bool, ratio: float = 1.2):
        monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
        monkeypatch.setattr(hardware, "_bf16_probe_faster", lambda: (ratio > 1.0, ratio))

    return make


def test_auto_is_fp32_on_a_cpu_without_native_bf16(cpu):
    cpu(native=False)
    choice = hardware.choose_precision("auto", torch.device("cpu"))
    assert choice.autocast is False and "no native bf16" in choice.reason


def test_auto_is_bf16_on_a_native_bf16_cpu_only_where_the_probe_finds_it_faster(cpu):
    cpu(native=True, ratio=1.3)
    assert hardware.choose_precision("auto", "cpu").autocast is True
    cpu(native=True, ratio=0.8)
    choice = hardware.choose_precision("auto", "cpu")
    assert choice.autocast is False and "0.80x" in choice.reason


@pytest.mark.parametrize("amp", [True, False])
def test_true_and_false_are_obeyed_whatever_the_hardware(cpu, amp):
    cpu(native=not amp)
    assert hardware.choose_precision(amp, "cpu").autocast is amp


@pytest.fixture
def fp32_flags():
    """torch's fp32 precision flags as a test found them, restored after it (they are process-wide)."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_fp32_on_a_gpu_is_ieee_fp32_not_tf32(fp32_flags):
    # torch's default runs cuDNN convolutions (the patch embedding) in TF32: a pinned fp32 study would not be fp32
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    hardware.choose_precision(False, "cpu")
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"  # off CUDA nothing is touched
    choice = hardware.choose_precision(False, torch.device("cuda", 0))
    assert choice.autocast is False and choice.reason == "fp32 (amp = false), TF32 off"
    assert torch.backends.cudnn.conv.fp32_precision == "ieee" and torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_this_machine_is_read_from_its_cpu_flags():
    flags = hardware.cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo here")
    assert hardware.cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


@pytest.mark.parametrize(
    "cpus, busy, threads, passive",
    [(2, 0.1, 2, False), (2, 1.0, 1, False), (2, 3.5, 1, False), (8, 2.0, 6, True), (4, 0.4, 4, False)],
)
def test_auto_threads_leave_the_busy_cpus_to_their_owners(monkeypatch, cpus, busy, threads, passive):
    monkeypatch.setattr(hardware, "available_cpus", lambda: cpus)
    policy = hardware.choose_thread_policy("auto", busy=busy)
    assert (policy.threads, policy.passive_wait, policy.busy) == (threads, passive, threads < cpus)


def test_a_thread_count_given_is_used_as_is(monkeypatch):
    monkeypatch.setattr(hardware, "available_cpus", lambda: 2)
    assert hardware.choose_thread_policy(3, busy=5.0) == hardware.ThreadPolicy(
        3, False, "3 thread(s) as asked (--threads)"
    )


@pytest.mark.parametrize(
    "argv, value",
    [
        (["train", "classify"], "auto"),
        (["train", "classify", "--threads", "1"], "1"),
        (["demo", "--threads=2"], "2"),
        (["demo", "--threads", "x"], "auto"),
        (["demo", "--threads", "0"], "auto"),
    ],
)
def test_threads_are_read_from_the_command_line_before_torch_starts(argv, value):
    assert hardware.threads_from_argv(argv) == value


def test_a_users_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert hardware.apply_thread_policy("auto", announce=False) is None


def test_available_cpus_respects_the_affinity_mask():
    assert 1 <= hardware.available_cpus() <= len(__import__("os").sched_getaffinity(0))


def test_the_busy_line_comes_once_when_steps_slow_down(monkeypatch):
    monkeypatch.delenv(hardware._BUSY_SAID, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    times = {"now": 0.0}
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: times["now"])
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    watch = hardware.BusyWatch(skip=1, measure=3, factor=3.0)
    said = []
    for took in [5.0, 1.0, 1.1, 0.9, 1.2, 2.5, 4.0, 9.0, 9.0]:  # warm-up, pace ~1 s, then a 4x step
        watch.begin()
        times["now"] += took
        said.append(watch.step())
        times["now"] += 30.0  # an evaluation between steps does not count
    lines = [line for line in said if line]
    assert len(lines) == 1 and said.index(lines[0]) == 6 and "4.0x the first steps' time" in lines[0]
    assert "--threads 1" in lines[0]


def test_the_busy_line_comes_when_the_load_exceeds_the_cpus(monkeypatch):
    monkeypatch.delenv(hardware._BUSY_SAID, raising=False)
    monkeypatch.setattr(hardware, "available_cpus", lambda: 2)
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    watch = hardware.BusyWatch(skip=0, measure=1)
    lines = [watch.step() for _ in range(3)]
    assert lines[0] is None and "load average is 5.0 on 2 CPU(s)" in lines[1] and lines[2] is None
    assert "already uses one thread" in lines[1] and "--threads 1" not in lines[1]  # consistent with the choice


def test_the_busy_notice_comes_once_per_command(monkeypatch, capsys):
    monkeypatch.delenv(hardware._BUSY_SAID, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(hardware, "available_cpus", lambda: 2)
    monkeypatch.setattr(hardware, "busy_cpus", lambda *a, **k: 2.0)
    threads = torch.get_num_threads()
    try:
        hardware.apply_thread_policy("auto")
        hardware.apply_thread_policy("auto")  # a sweep's cell: it inherits the command's environment
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().err.count("the machine is busy") == 1
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    watch = hardware.BusyWatch(skip=0, measure=1)
    assert [watch.step() for _ in range(3)] == [None, None, None]  # said at the start already


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(monkeypatch):
    import time

    import lapheads
    from lapheads.errors import InputError
    from lapheads.models.gpt import GPT, GPTConfig

    start = time.perf_counter()
    with pytest.raises(
        InputError, match=r"GPT\(depth=100000.*parameters needs at least ~[\d,.]+ GiB .*LAPHEADS_ALLOW_LARGE=1"
    ):
        GPT(GPTConfig(depth=100000))
    with pytest.raises(InputError, match=r"vit_fmnist_patch4 with depth=100000: ~[\d,]+ parameters needs"):
        lapheads.create_vit("vit_fmnist_patch4", 0, depth=100000)
    assert time.perf_counter() - start < 5  # estimated, never allocated
    assert GPTConfig(depth=20, vocab_size=65536).estimated_params() == 560_988_160  # the paper's d20
    with torch.device("meta"):  # a meta-device build allocates nothing and is not checked
        assert GPT(GPTConfig(depth=1000, vocab_size=64)).config.depth == 1000
    monkeypatch.setattr(hardware, "available_memory_bytes", lambda device="cpu": 10**6)
    with pytest.raises(InputError, match="needs at least ~0.0 GiB but cpu has 0.0 GiB"):
        hardware.check_fits("a model", 2 * 10**6)
    monkeypatch.setenv(hardware.ALLOW_LARGE, "1")
    hardware.check_fits("a model", 2 * 10**6)  # the override for machines that really hold it


def test_cpu_kernels_are_pinned_in_a_given_environment_and_a_bad_pin_is_one_line(monkeypatch):
    from lapheads.errors import InputError

    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx", "avx2", "fma"})
    environ: dict[str, str] = {}
    assert hardware.pin_cpu_kernels("avx2", environ) == environ
    assert environ == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}
    assert hardware.pin_cpu_kernels("native", {}) == {}
    with pytest.raises(InputError, match="this CPU lacks avx512f"):
        hardware.pin_cpu_kernels("avx512", {})
    with pytest.raises(InputError, match=r"--cpu-kernels 'sse'; allowed: native, avx2, avx512"):
        hardware.pin_cpu_kernels("sse", {})
    # what runs: ATen as torch reports it, MKL and oneDNN at the CPU's best unless capped
    assert hardware.cpu_kernels(["avx2", "avx512f"], "AVX512") == {
        "aten": "AVX512",
        "mkl": "AVX512",
        "onednn": "AVX512",
    }
    assert hardware.cpu_kernels(["avx2", "avx512f"], "AVX2", environ)["onednn"] == "AVX2"


def test_help_says_nothing_about_a_busy_machine(monkeypatch, capsys):
    """Issue 61: ``lapheads train lm --help`` printed the busy-machine line above its usage."""
    from lapheads import hardware

    monkeypatch.delenv(hardware._BUSY_SAID, raising=False)
    said = []
    monkeypatch.setattr(hardware, "apply_thread_policy", lambda threads, announce=True: said.append(announce))
    hardware.apply_cli_thread_policy(["train", "lm", "--help"])
    hardware.apply_cli_thread_policy(["train", "lm", "--preset", "shakespeare-cpu"])
    assert said == [False, True]
