"""Decode steps through C (cpu_decode.py): greedy outputs stay HF ``generate``'s on Llama, Qwen2,
Mistral, Qwen3, Gemma 1-3, Granite and Phi-3, all layers in one call and with the linears' own
forwards between the C pieces; a bfloat16 decode gives the modules' outputs; what the path does
not take goes through the modules."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
from llmfleet.server.core.request import Request, SamplingParams
from llmfleet.server.runner import cpu_decode, cpu_kernels
from llmfleet.server.runner.attention import model_logits
from llmfleet.server.runner.builtin_models import BUILTINS, build_model_dir, resolve_model
from llmfleet.server.runner.step_inputs import build_step_inputs
from llmfleet.server.runner.torch_runner import TorchModelRunner
from tests.server.runner.device import DEVICE
from tests.server.runner.hand_scheduler import HandScheduler, hf_greedy

pytestmark = [
    pytest.mark.skipif(DEVICE != "cpu", reason="the C decode runs on a CPU"),
    pytest.mark.skipif(not cpu_kernels.built(), reason="no C compiler for the CPU kernels"),
]


def make_runner(model_dir, dtype: str = "float32", num_kv_blocks: int = 200) -> TorchModelRunner:
    config = EngineConfig(dtype=dtype, kv_block_size=4, num_kv_blocks=num_kv_blocks)
    return TorchModelRunner(model_dir, config, device="cpu")


def prompts_for(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in lengths]


def run(runner, prompts, max_tokens, chunk: int = 1 << 30) -> list[list[int]]:
    hand = HandScheduler(runner)
    for i, prompt in enumerate(prompts):
        hand.add(str(i), prompt, max_tokens[i], chunk=chunk)
    outputs = hand.run()
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("path", ["one call", "linears between"])
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-mistral"])
def test_greedy_outputs_are_hf_generate(name, path):
    model_dir = resolve_model(f"builtin:{name}")
    prompts = prompts_for(5, (3, 150, 8, 90, 1, 40))  # decode groups of very different lengths
    max_tokens = [12, 9, 14, 10, 16, 11]
    runner = make_runner(model_dir)
    fused = runner.fused_decode
    assert fused is not None and fused.c_rows > 0  # float32 weights: the few-row linear reads them all
    if path == "linears between":
        fused.c_rows = 0
    taken = []
    logits = fused.logits
    fused.logits = lambda step, pad=False: taken.append(logits(step, pad)) or taken[-1]
    assert run(runner, prompts, max_tokens, chunk=5) == hf_greedy(model_dir, prompts, max_tokens)
    assert any(t is not None for t in taken)  # decode steps took the path
    assert any(t is None for t in taken)  # steps with prompt chunks did not


def greedy_matches_hf(runner, model_dir, prompts, max_tokens, path: str) -> None:
    """The runner's greedy outputs, its decode steps all in one C call or with the linears' own
    forwards between the C pieces (``path``), are HF ``generate``'s."""
    if path == "linears between":
        runner.fused_decode.c_rows = 0
    assert run(runner, prompts, max_tokens, chunk=7) == hf_greedy(model_dir, prompts, max_tokens)


def bfloat16_matches_modules(model_dir, prompts, max_tokens, monkeypatch) -> None:
    """A bfloat16 runner through the C decode gives the tokens of one through the modules."""
    fused = make_runner(model_dir, "bfloat16")
    assert fused.fused_decode is not None
    monkeypatch.setenv("LLMFLEET_FUSED_DECODE", "0")
    modules = make_runner(model_dir, "bfloat16")
    assert modules.fused_decode is None
    assert run(fused, prompts, max_tokens) == run(modules, prompts, max_tokens)


def qwen3_model(target):
    """A tiny Qwen3 whose query and key norms have weights of their own (the built-in models'
    norms are all ones, which would hide a weight the kernel skipped or misplaced)."""
    from transformers import AutoModelForCausalLM

    spec = dataclasses.replace(BUILTINS["tiny-qwen2"], architecture="qwen3", extra_config=(("head_dim", 16),))
    model_dir = build_model_dir(spec, target)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=generator))
    model.save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("path", ["one call", "linears between"])
def test_qwen3s_head_norms(tmp_path, path):
    model_dir = qwen3_model(tmp_path / "qwen3")
    prompts = prompts_for(8, (3, 70, 9, 1, 33))
    max_tokens = [12, 9, 14, 16, 11]
    runner = make_runner(model_dir)
    fused = runner.fused_decode
    assert fused is not None and fused.layers[0].q_norm and fused.layers[0].k_norm
    greedy_matches_hf(runner, model_dir, prompts, max_tokens, path)


def test_qwen3_in_bfloat16_gives_the_modules_outputs(tmp_path, monkeypatch):
    bfloat16_matches_modules(qwen3_model(tmp_path / "qwen3"), prompts_for(9, (7, 33, 2, 64)), [20] * 4, monkeypatch)


GEMMAS = {
    "gemma": (),
    # logit caps low enough to bite: 1 on the attention's scores, 3 on the logits
    "gemma2": (("attn_logit_softcapping", 1.0), ("final_logit_softcapping", 3.0), ("sliding_window", 6)),
    # a sliding layer and a full one: two rotary tables (10,000 and 1,000,000), the window 6 tokens
    "gemma3_text": (("layer_types", ("sliding_attention", "full_attention")), ("sliding_window", 6)),
}


def gemma_model(architecture: str, target):
    """A tiny Gemma of ``architecture`` whose RMSNorms (Gemma's: times 1 + weight) have weights of
    their own, as ``qwen3_model`` gives Qwen3's."""
    from transformers import AutoModelForCausalLM

    extra = (("head_dim", 16), ("query_pre_attn_scalar", 16), *GEMMAS[architecture])
    spec = dataclasses.replace(BUILTINS["tiny"], architecture=architecture, extra_config=extra)
    model_dir = build_model_dir(spec, target)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("path", ["one call", "linears between"])
@pytest.mark.parametrize("architecture", list(GEMMAS))
def test_gemmas_norms_gelu_caps_and_rotary_tables(tmp_path, architecture, path):
    model_dir = gemma_model(architecture, tmp_path / architecture)
    prompts = prompts_for(10, (3, 40, 9, 1, 17))
    max_tokens = [12, 9, 14, 16, 11]
    runner = make_runner(model_dir)
    fused = runner.fused_decode
    assert fused is not None and fused.sizes.gemma_norms and fused.sizes.gelu_tanh
    greedy_matches_hf(runner, model_dir, prompts, max_tokens, path)


def test_gemma3_in_bfloat16_gives_the_modules_outputs(tmp_path, monkeypatch):
    model_dir = gemma_model("gemma3_text", tmp_path / "gemma3")
    bfloat16_matches_modules(model_dir, prompts_for(11, (7, 33, 2, 20)), [16] * 4, monkeypatch)


def multimodal_gemma3_model(target):
    """A tiny Gemma 3 as its 4B and larger checkpoints come: Gemma3ForConditionalGeneration, a
    vision tower beside the text decoder, every size under ``text_config``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from llmfleet.server.runner.builtin_models import build_tokenizer

    text = {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 6,
        "max_position_embeddings": 1024,
    }
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = Gemma3Config(text_config=text, vision_config=vision | {"image_size": 28, "patch_size": 14})
    torch.manual_seed(9)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.5 * torch.randn(param.shape) if "norm" in name else 0.08 * torch.randn(param.shape))
    model.save_pretrained(target)
    build_tokenizer(512).save_pretrained(target)
    return target


@pytest.mark.parametrize("path", ["one call", "linears between"])
def test_a_multimodal_gemma3_serves_text_through_its_decoder(tmp_path, path):
    model_dir = multimodal_gemma3_model(tmp_path / "gemma3-mm")
    prompts = prompts_for(12, (3, 40, 9, 17))
    max_tokens = [10, 8, 12, 9]
    runner = make_runner(model_dir)
    assert runner.max_model_len == 1024  # its text decoder's context
    assert runner.fused_decode is not None
    greedy_matches_hf(runner, model_dir, prompts, max_tokens, path)


# Granite's scalars, far from 1 as its checkpoints' are (3.x 8B: 12, 0.22, 16, 1/128)
GRANITE = (
    ("embedding_multiplier", 12.0),
    ("residual_multiplier", 0.22),
    ("logits_scaling", 8.0),
    ("attention_multiplier", 0.0625),
)


def granite_model(target):
    spec = dataclasses.replace(BUILTINS["tiny"], architecture="granite", extra_config=GRANITE)
    return build_model_dir(spec, target)


@pytest.mark.parametrize("path", ["one call", "linears between"])
def test_granites_scalars(tmp_path, path):
    model_dir = granite_model(tmp_path / "granite")
    runner = make_runner(model_dir)
    fused = runner.fused_decode
    assert fused is not None and fused.sizes.residual_scale == pytest.approx(0.22)
    greedy_matches_hf(runner, model_dir, prompts_for(13, (3, 40, 9, 1, 17)), [12, 9, 14, 16, 11], path)
    # the logits too, which greedy tokens would not show divided or not
    step = decode_step(runner)
    expected = model_logits(runner.model, step.input_ids, step.positions, step.logit_rows, step.meta)
    torch.testing.assert_close(fused.logits(step), expected, rtol=1e-4, atol=1e-4)


def test_granite_in_bfloat16_gives_the_modules_outputs(tmp_path, monkeypatch):
    model_dir = granite_model(tmp_path / "granite")
    bfloat16_matches_modules(model_dir, prompts_for(14, (7, 33, 2, 20)), [16] * 4, monkeypatch)


def phi3_model(target, partial_rotary: float = 1.0):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary}
    spec = dataclasses.replace(BUILTINS["tiny"], architecture="phi3", extra_config=(("rope_parameters", rope),))
    return build_model_dir(spec, target)


@pytest.mark.parametrize("path", ["one call", "linears between"])
def test_phi3s_fused_linears(tmp_path, path):
    model_dir = phi3_model(tmp_path / "phi3")
    runner = make_runner(model_dir)
    fused = runner.fused_decode
    assert fused is not None and fused.sizes.fused_qkv and fused.sizes.fused_gate_up
    greedy_matches_hf(runner, model_dir, prompts_for(15, (3, 40, 9, 1, 17)), [12, 9, 14, 16, 11], path)


def test_phi3_in_bfloat16_gives_the_modules_outputs(tmp_path, monkeypatch):
    bfloat16_matches_modules(phi3_model(tmp_path / "phi3"), prompts_for(16, (7, 33, 2, 20)), [16] * 4, monkeypatch)


def test_a_partial_rotary_keeps_the_modules(tmp_path):
    """Phi-4-mini turns 3/4 of each head; the C rotary turns all of it."""
    model_dir = phi3_model(tmp_path / "phi4-mini", partial_rotary=0.75)
    runner = make_runner(model_dir)
    assert runner.fused_decode is None
    prompts, max_tokens = prompts_for(17, (3, 40, 9)), [12, 9, 14]
    assert run(runner, prompts, max_tokens) == hf_greedy(model_dir, prompts, max_tokens)


@pytest.mark.parametrize("architecture", ["tiny-mistral", "tiny-qwen2"])
def test_a_sliding_window_shorter_than_the_context(tmp_path, architecture):
    spec = dataclasses.replace(BUILTINS[architecture], sliding_window=6)
    model_dir = build_model_dir(spec, tmp_path / architecture)
    prompts = prompts_for(4, (20, 3, 11))
    max_tokens = [14, 10, 16]
    runner = make_runner(model_dir)
    assert runner.fused_decode is not None
    assert run(runner, prompts, max_tokens) == hf_greedy(model_dir, prompts, max_tokens)


def test_bfloat16_gives_the_modules_outputs(monkeypatch):
    bfloat16_matches_modules(resolve_model("builtin:tiny"), prompts_for(6, (7, 33, 2, 64)), [20] * 4, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_is_torchs_silu_times_up(dtype):
    """silu(gate) * up, 16 values at a time then the rest: torch's bits in bfloat16 and within an
    ulp in float32, over the whole range (exp(-x) overflowing below -88.7, underflowing above 87)."""
    gate, up = gate_and_up(dtype)
    expected = torch.nn.functional.silu(gate) * up
    for got in gates_times_up(gate, up, gelu_tanh=0):
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=2.5e-7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_is_torchs_gelu_tanh_times_up(dtype):
    """Gemma's gelu(gate, approximate="tanh") * up: within a float32 ulp or two of torch's, whose
    tanh is Sleef's (ours is Cephes'), so in bfloat16 the same bits but where the float sits at a
    rounding edge. Where tanh is near -1, 1 + tanh keeps only a few bits in either."""
    gate, up = gate_and_up(dtype)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    for got in gates_times_up(gate, up, gelu_tanh=1):
        if dtype == torch.bfloat16:
            assert (got != expected).float().mean() < 0.01
            torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def gate_and_up(dtype):
    """Gates over the whole range, and ups: enough values for the threads to share, the last 10
    past the vectors."""
    torch.manual_seed(0)
    rows, intermediate = 66, 1005
    edges = torch.tensor([-200.0, -89.0, -88.5, -0.0, 0.0, 87.5, 88.0, 200.0])
    gate = torch.cat([torch.randn(rows * intermediate - len(edges)) * 30, edges]).to(dtype).view(rows, intermediate)
    return gate, torch.randn(rows, intermediate).to(dtype)


def gates_times_up(gate, up, gelu_tanh: int):
    """The C step's act(gate) * up at 1 and 2 threads."""
    rows, intermediate = gate.shape
    sizes = cpu_kernels.DecodeModel(
        intermediate=intermediate, bf16=int(gate.dtype == torch.bfloat16), gelu_tanh=gelu_tanh
    )
    for threads in (1, 2):
        got = gate.clone()
        step = cpu_kernels.DecodeStep(m=rows, num_threads=threads)
        cpu_kernels.decode_kernels().llmfleet_gate_times_up(sizes, step, got.data_ptr(), up.data_ptr())
        yield got


def decode_step(runner, count: int = 2):
    """``count`` one-token prompts prefilled through the runner, then their decode step's inputs."""
    requests = []
    for i in range(count):
        request = Request(f"r{i}", [10 + i], SamplingParams(max_tokens=4, temperature=0))
        request.block_table = [i]
        requests.append(request)
    tokens = runner.execute(SchedulerOutput([ScheduledRequest(r, 1) for r in requests]))
    for request, token in zip(requests, tokens, strict=True):
        request.num_computed_tokens = 1
        request.output_token_ids.append(token.token_id)
    return build_step_inputs(SchedulerOutput([ScheduledRequest(r, 1) for r in requests]), runner.cache, runner.device)


@pytest.mark.parametrize("c_rows", [None, 0], ids=["one call", "linears between"])
def test_a_slot_outside_the_cache_raises_with_nothing_written(c_rows):
    runner = make_runner(resolve_model("builtin:tiny"), num_kv_blocks=8)
    fused = runner.fused_decode
    fused.c_rows = fused.c_rows if c_rows is None else c_rows
    step = decode_step(runner)
    step.meta.slot_mapping[1] = runner.cache.num_blocks * runner.cache.block_size
    before = [k.clone() for k in runner.cache.keys]
    with pytest.raises(IndexError):
        fused.logits(step)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.cache.keys, strict=True))


def test_steps_with_prompt_tokens_go_through_the_modules():
    runner = make_runner(resolve_model("builtin:tiny"))
    request = Request("p", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    request.block_table = [0]
    step = build_step_inputs(SchedulerOutput([ScheduledRequest(request, 3)]), runner.cache, runner.device)
    assert runner.fused_decode.logits(step) is None


def test_models_it_does_not_take_keep_their_modules(tmp_path, monkeypatch):
    gelu = dataclasses.replace(BUILTINS["tiny"], extra_config=(("hidden_act", "gelu"),))
    assert make_runner(build_model_dir(gelu, tmp_path / "gelu")).fused_decode is None
    monkeypatch.setattr(cpu_decode, "ARCHITECTURES", ())
    assert make_runner(resolve_model("builtin:tiny")).fused_decode is None
    monkeypatch.undo()
    monkeypatch.setenv("LLMFLEET_FUSED_DECODE", "0")
    assert make_runner(resolve_model("builtin:tiny")).fused_decode is None


def test_a_probe_that_disagrees_keeps_the_modules(monkeypatch):
    original = cpu_decode.FusedDecode.logits

    def off_by_one(self, step, pad=False):
        logits = original(self, step, pad)
        return None if logits is None else logits + 1

    monkeypatch.setattr(cpu_decode.FusedDecode, "logits", off_by_one)
    assert make_runner(resolve_model("builtin:tiny")).fused_decode is None
