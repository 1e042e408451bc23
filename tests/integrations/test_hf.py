"""Hugging Face transformers (v5): the "mok" experts implementation and MoKSparseMoeBlock.

Everything runs on tiny random models built from configs (no download). The reference is the
stock model in float64 with transformers' eager experts; mok computes the experts in bf16.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from helpers import DEVICE, assert_close, config, cosine
from multiproc import run_ranks

pytest.importorskip(
    "transformers", minversion="5", reason="the HF integration needs transformers >= 5 (pip install mok-torch[hf])"
)

from torch import nn
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock

import mok_torch as mok
from mok_torch.integrations import hf

H, I, E, K, VOCAB = 64, 32, 8, 2, 128


def _qwen3_config(**kw: object) -> Qwen3MoeConfig:
    kw = {
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": 96,
        "moe_intermediate_size": I,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": E,
        "num_experts_per_tok": K,
        "max_position_embeddings": 64,
        **kw,
    }
    return Qwen3MoeConfig(**kw)


def _init_moe(module: nn.Module, scale: float = 0.3) -> None:
    """Router and experts at `scale` x 1/sqrt(fan_in): the MoE output is a fair share of the
    residual stream, so the logits and gradients see the experts, while bf16 errors stay within
    the tolerance table after two layers."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter):
                fan_in = m.gate_up_proj.shape[-1]
                m.gate_up_proj.normal_(0, scale * fan_in**-0.5)
                m.down_proj.normal_(0, scale * m.down_proj.shape[-1] ** -0.5)
            elif type(m).__name__.endswith("TopKRouter"):
                m.weight.normal_(0, m.weight.shape[-1] ** -0.5)


def _qwen3_model(**kw: object) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_qwen3_config(**kw))
    _init_moe(model)
    return model.to(DEVICE)


def _reference(model: nn.Module) -> nn.Module:
    """The stock model in float64 with transformers' eager experts."""
    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")
    return ref


def _mok_config() -> mok.MoKConfig:
    return config(expert_alignment=8)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    dlogits = torch.randn(2, 8, VOCAB, generator=g, dtype=torch.float64)
    return ids.to(DEVICE), dlogits.to(DEVICE)


def _forward_backward(model: nn.Module) -> dict[str, torch.Tensor]:
    """Logits and every parameter's gradient after one forward and backward."""
    ids, dlogits = _batch()
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    (logits * dlogits.to(logits.dtype)).sum().backward()
    out = {"logits": logits.detach()}
    out.update({name: p.grad for name, p in model.named_parameters()})
    return out


def _assert_all_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert_close(name, got[name], want[name])


def _converted(model: nn.Module) -> nn.Module:
    return hf.convert_model(copy.deepcopy(model), config=_mok_config())


def test_converted_model_matches_stock_fp64():
    model = _qwen3_model()
    ref = _reference(model)
    converted = _converted(model)
    assert all(isinstance(layer.mlp, hf.MoKSparseMoeBlock) for layer in converted.model.layers)
    got, want = _forward_backward(converted), _forward_backward(ref)
    _assert_all_close(got, want)
    # The comparison sees the experts: one expert of layer 1 made 10% larger fails it.
    with torch.no_grad():
        ref.model.layers[1].mlp.experts.down_proj[3] *= 1.1
    with pytest.raises(AssertionError):
        _assert_all_close(got, _forward_backward(ref))


def test_gradients_reach_the_original_parameters():
    model = _qwen3_model()
    experts = model.model.layers[0].mlp.experts
    gate_up, down, router = experts.gate_up_proj, experts.down_proj, model.model.layers[0].mlp.gate.weight
    hf.convert_model(model, config=_mok_config())
    block = model.model.layers[0].mlp
    assert block.experts.gate_up_proj is gate_up and block.experts.down_proj is down and block.gate.weight is router
    _forward_backward(model)
    for p in (gate_up, down, router):
        assert p.grad is not None and p.grad.dtype == p.dtype and p.grad.abs().sum() > 0


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_block_matches_stock_block(norm_topk_prob):
    cfg = _qwen3_config(norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    stock = Qwen3MoeSparseMoeBlock(cfg)
    _init_moe(stock, scale=1.0)
    stock = stock.to(DEVICE)
    ref = copy.deepcopy(stock).double()
    ref.experts.config._experts_implementation = "eager"
    block = hf.MoKSparseMoeBlock.from_block(copy.deepcopy(stock), mok_config=_mok_config())
    x = torch.randn(2, 5, H, device=DEVICE)
    dy = torch.randn(2, 5, H, device=DEVICE, dtype=torch.float64)

    def run(b: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        xx = x.detach().to(dtype).clone().requires_grad_()
        y = b(xx)
        assert y.shape == x.shape and y.dtype == dtype
        (y * dy.to(dtype)).sum().backward()
        return {"y": y.detach(), "dx": xx.grad, **{n: p.grad for n, p in b.named_parameters()}}

    got, want = run(block, torch.float32), run(ref, torch.float64)
    _assert_all_close(got, want)
    with torch.no_grad():
        ref.experts.gate_up_proj[int(block.gate(x.reshape(-1, H))[2][0, 0])] *= 1.1
    ref.zero_grad()
    with pytest.raises(AssertionError):
        _assert_all_close(got, run(ref, torch.float64))


# The other blocks convert_model replaces: (config class, its kwargs, modeling module, block class).
OTHER_BLOCKS = [
    ("MixtralConfig", {"intermediate_size": I, "num_local_experts": E}, "mixtral", "MixtralSparseMoeBlock"),
    (
        "OlmoeConfig",
        {"intermediate_size": I, "num_experts": E, "norm_topk_prob": True},
        "olmoe",
        "OlmoeSparseMoeBlock",
    ),
    (
        "Qwen3VLMoeTextConfig",
        {"moe_intermediate_size": I, "num_experts": E},
        "qwen3_vl_moe",
        "Qwen3VLMoeTextSparseMoeBlock",
    ),
]


@pytest.mark.parametrize("spec", OTHER_BLOCKS, ids=[s[3] for s in OTHER_BLOCKS])
def test_other_blocks_convert(spec):
    config_name, kw, module_name, block_name = spec
    transformers = importlib.import_module("transformers")
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    cfg = getattr(transformers, config_name)(hidden_size=H, num_experts_per_tok=K, **kw)
    torch.manual_seed(0)
    holder = nn.Module()
    holder.mlp = getattr(modeling, block_name)(cfg)
    _init_moe(holder, scale=1.0)
    holder = holder.to(DEVICE)
    ref = copy.deepcopy(holder.mlp).double()
    ref.experts.config._experts_implementation = "eager"
    hf.convert_model(holder, config=_mok_config())
    assert isinstance(holder.mlp, hf.MoKSparseMoeBlock) and holder.mlp.norm_topk_prob
    x = torch.randn(1, 6, H, device=DEVICE)
    assert_close("y", holder.mlp(x), ref(x.double()))


def test_experts_interface_gives_the_converted_result():
    hf.register()
    hf.register()  # idempotent
    assert ALL_EXPERTS_FUNCTIONS["mok"] is hf.experts_forward
    model = _qwen3_model()
    via_interface = copy.deepcopy(model)
    via_interface.set_experts_implementation("mok")
    hf.configure_experts(via_interface, config=_mok_config())
    via_config = _qwen3_model(experts_implementation="mok")  # Qwen3MoeConfig(experts_implementation=...)
    hf.configure_experts(via_config, config=_mok_config())
    want = _forward_backward(_converted(model))
    for m in (via_interface, via_config):
        assert m.config._experts_implementation == "mok"
        got = _forward_backward(m)
        # Without ties, the HF router and mok's choose the same experts with the same weights.
        for name in want:
            assert torch.equal(got[name], want[name]), name


EP_TOKENS = [5, 7]  # tokens of rank 0 and rank 1; one rank alone takes them all


def ep_scenario(rank: int, world: int, group: object, device: str) -> dict[str, torch.Tensor]:
    """A converted Qwen3 block with every expert on every rank, run over this rank's tokens."""
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    torch.manual_seed(0)
    stock = Qwen3MoeSparseMoeBlock(_qwen3_config(norm_topk_prob=True))
    _init_moe(stock, scale=1.0)
    block = hf.MoKSparseMoeBlock.from_block(stock.to(dev), mok_config=_mok_config(), group=group)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(sum(EP_TOKENS), H, generator=g), torch.randn(sum(EP_TOKENS), H, generator=g)
    mine = slice(0, None) if world == 1 else slice(sum(EP_TOKENS[:rank]), sum(EP_TOKENS[: rank + 1]))
    x_TH = x[mine].to(dev).requires_grad_()
    y = block(x_TH)
    (y * dy[mine].to(dev)).sum().backward()
    grads = {n: p.grad.cpu() for n, p in block.named_parameters()}
    return {"y": y.detach().cpu(), "dx": x_TH.grad.cpu(), **grads}


@pytest.mark.multiprocess
def test_expert_parallel_block_with_replicated_experts():
    """EP 2 over a model holding all experts on each rank: rank r computes experts [4r, 4r+4)."""
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("EP 2 on CUDA needs 2 GPUs")
    base = ep_scenario(0, 1, None, DEVICE)
    ranks = run_ranks(2, "test_hf.ep_scenario", DEVICE, device=DEVICE)
    for key in ("y", "dx"):
        assert_close(key, torch.cat([r[key] for r in ranks]), base[key])
    for key in ("experts.gate_up_proj", "experts.down_proj"):
        for rank, r in enumerate(ranks):  # only this rank's experts have a gradient here
            others = torch.ones(E, dtype=torch.bool)
            others[rank * E // 2 : (rank + 1) * E // 2] = False
            assert r[key][others].abs().sum() == 0 and r[key][~others].abs().sum() > 0, key
        assert_close(key, ranks[0][key] + ranks[1][key], base[key])
    assert_close("gate.weight", ranks[0]["gate.weight"] + ranks[1]["gate.weight"], base["gate.weight"])


@pytest.mark.parametrize("layout", ["transposed", "interleaved"])
def test_expert_weight_layouts(layout):
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(_qwen3_config())
    _init_moe(experts)
    other = copy.deepcopy(experts)
    with torch.no_grad():
        gate, up = experts.gate_up_proj[:, :I], experts.gate_up_proj[:, I:]
        if layout == "transposed":
            other.is_transposed = True
            other.gate_up_proj = nn.Parameter(experts.gate_up_proj.transpose(1, 2).contiguous())
            other.down_proj = nn.Parameter(experts.down_proj.transpose(1, 2).contiguous())
        else:
            other.is_concatenated = False
            other.gate_up_proj = nn.Parameter(torch.stack([gate, up], dim=2).reshape(E, 2 * I, H))
    x = torch.randn(6, H)
    top = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 0], [3, 2]])
    w = torch.rand(6, K)
    want = hf.run_experts(experts, x, top, w, config=_mok_config())
    assert torch.equal(hf.run_experts(other, x, top, w, config=_mok_config()), want)


def test_bitwise_repeatable():
    model = _converted(_qwen3_model())
    first, second = _forward_backward(model), _forward_backward(model)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_convert_keeps_parameters_and_state_dict():
    model = _qwen3_model()
    before = [(name, p) for name, p in model.named_parameters()]
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    model.train()
    hf.convert_model(model, config=_mok_config())
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(p is q for (_, p), (_, q) in zip(after, before, strict=True))
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    assert list(model.state_dict()) == list(shapes)
    assert all(layer.mlp.training for layer in model.model.layers)
    hf.convert_model(model, config=_mok_config().replace(minibatch_size=16))  # converting again reconfigures
    assert model.model.layers[0].mlp.mok_config.minibatch_size == 16


def _state_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


def test_save_converted_load_stock(tmp_path):
    converted = _converted(_qwen3_model())
    converted.save_pretrained(tmp_path)
    stock = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    assert isinstance(stock.model.layers[0].mlp, Qwen3MoeSparseMoeBlock)
    _state_equal(stock, converted)


def test_save_stock_load_converted(tmp_path):
    stock = _qwen3_model()
    stock.save_pretrained(tmp_path)
    loaded = hf.convert_model(Qwen3MoeForCausalLM.from_pretrained(tmp_path).to(DEVICE), config=_mok_config())
    _state_equal(loaded, stock)
    hf.register()
    via_interface = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="mok").to(DEVICE)
    hf.configure_experts(via_interface, config=_mok_config())
    assert torch.equal(_forward_backward(via_interface)["logits"], _forward_backward(loaded)["logits"])


def test_rejects_other_activations():
    model = _qwen3_model(hidden_act="gelu")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts .*GELUActivation \(hidden_act='gelu'\)"):
        hf.convert_model(model, config=_mok_config())
    assert isinstance(model.model.layers[0].mlp, Qwen3MoeSparseMoeBlock)  # nothing replaced
    with pytest.raises(ValueError, match="SiLU"):
        hf.configure_experts(model)


def test_rejects_biases_and_custom_gating():
    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=E,
        num_experts_per_tok=K,
    )
    model = GptOssForCausalLM(cfg)
    with pytest.raises(ValueError, match="no sparse MoE block"):
        hf.convert_model(model)
    hf.register()
    model.set_experts_implementation("mok")
    with pytest.raises(ValueError, match=r"GptOssExperts: mok runs experts without biases"):
        model(torch.zeros(1, 4, dtype=torch.long))
    # The same experts without biases still gate their own way (clamp, alpha, up + 1).
    experts = model.model.layers[0].mlp.experts
    experts.has_bias, experts.gate_up_proj_bias, experts.down_proj_bias = False, None, None
    with pytest.raises(ValueError, match=r"_apply_gate"):
        hf.check_experts(experts)


def test_rejects_bad_configs_and_models():
    model = _qwen3_model()
    with pytest.raises(ValueError, match="swiglu_limit"):
        hf.convert_model(model, config=mok.MoKConfig(swiglu_limit=7.0))
    with pytest.raises(TypeError, match="MoKConfig"):
        hf.convert_model(model, config="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no sparse MoE block"):
        hf.convert_model(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no experts module"):
        hf.configure_experts(nn.Linear(4, 4))


def test_mxfp8_experts_in_a_converted_model():
    """precision="mxfp8" through the HF block: the config reaches the layer, which runs quantized.

    The layer-level accuracy bar (cosine >= 0.996 per gradient) is tested in
    test_mxfp8_layer.py; through a whole model the errors of two quantized MoE layers and the
    attention between them compound, so this checks every gradient at cosine >= 0.99.
    """
    mx = mok.MoKConfig(precision="mxfp8", backend="reference", expert_alignment=32)
    model = _qwen3_model()
    ref = _reference(model)
    got = _forward_backward(hf.convert_model(copy.deepcopy(model), config=mx))
    want = _forward_backward(ref)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.isfinite(got[name].float()).all(), name
        assert cosine(got[name], want[name]) >= 0.99, f"{name}: cosine {cosine(got[name], want[name]):.5f}"
    # it really ran in MXFP8: the experts' gradients differ from the BF16 layer's
    bf16 = _forward_backward(hf.convert_model(copy.deepcopy(model), config=_mok_config()))
    expert_grads = [n for n in want if "experts" in n]
    assert expert_grads and all(not torch.equal(got[n], bf16[n]) for n in expert_grads)
