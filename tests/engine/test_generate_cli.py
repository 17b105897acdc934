"""`python -m xlaserve.generate` on the embedded default model, as `make serve` runs it."""
import json
import subprocess
import sys

import pytest

from xlaserve.server_args import ServerArgs


def test_generate_cli_prints_json_with_the_greedy_answer():
    # float32 activations: the exact model's answer. (With the default q8 ones the default model
    # answers "L'Étoile, la Mar", as llama.cpp's llama-server does on the same file.)
    result = subprocess.run(
        [sys.executable, "-m", "xlaserve.generate", "--prompt", "What is the capital of France?",
         "--max-new-tokens", "8", "--json", "--quantized-activations", "float32"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Paris" in output["text"]
    assert 1 <= output["meta_info"]["completion_tokens"] == len(output["output_ids"]) <= 8
    assert output["meta_info"]["prompt_tokens"] > 8  # the chat template was applied
    assert output["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_server_args_flags_use_sglang_names_and_types():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--model-path", "Qwen/Qwen2.5-0.5B-Instruct", "--dtype", "bfloat16", "--page-size", "32",
         "--skip-tokenizer-init", "--disable-radix-cache"]))
    assert args == ServerArgs(model_path="Qwen/Qwen2.5-0.5B-Instruct", dtype="bfloat16",
                              page_size=32, skip_tokenizer_init=True, disable_radix_cache=True)
    defaults = ServerArgs.from_cli_args(parser.parse_args([]))
    assert defaults == ServerArgs()


def test_sglang_and_vllm_flag_names_and_values_are_taken_as_ours():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--tensor-parallel-size", "4", "--expert-parallel-size", "2", "--data-parallel-size", "1",
         "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
         "--grammar-backend", "xgrammar", "--enable-cache-report", "--kv-cache-dtype", "auto",
         "--max-model-len", "2048", "--max-num-seqs", "32",
         "--enable-auto-tool-choice"]))
    assert args == ServerArgs(tp_size=4, ep_size=2, tool_call_parser="qwen25",
                              reasoning_parser="deepseek-r1", grammar_backend="llguidance",
                              enable_cache_report=True, context_length=2048,
                              max_running_requests=32,
                              enable_auto_tool_choice=True)
    vllm_gpt_oss = ServerArgs.from_cli_args(parser.parse_args(
        ["--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss"]))
    assert (vllm_gpt_oss.tool_call_parser, vllm_gpt_oss.reasoning_parser) == ("gpt-oss", "gpt-oss")
    assert ServerArgs(grammar_backend="outlines").grammar_backend == "llguidance"  # the Engine's path


def test_vllms_fp8_kv_cache_is_e4m3_and_an_embedding_server_refuses_one_in_one_line():
    assert ServerArgs(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    result = subprocess.run([sys.executable, "-m", "xlaserve.launch_server", "--kv-cache-dtype",
                             "fp8", "--is-embedding"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(
        "--kv-cache-dtype fp8_e4m3 with an embedding model (--is-embedding / --runner pooling): "
        "not supported")


def test_a_negative_max_tools_stops_start_up_instead_of_refusing_every_chat_request():
    with pytest.raises(ValueError, match="--max-tools must be 0 or more; got -1"):
        ServerArgs(max_tools=-1)
    assert ServerArgs(max_tools=0).max_tools == 0  # no tools allowed: chat without tools still runs
