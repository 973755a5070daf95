#!/usr/bin/env python3
"""Trains the small Kimi-K3-architecture model we ship (models/), on a GPU, in PyTorch.

The model is the K3 math of shared/spec/MODEL.md with every K3 switch on: KDA with the bounded
decay gate (gate_lower_bound -5) and a full-rank output gate, gated MLA with a query LoRA and the
shared unrotated key slice, block attention residuals, a latent MoE (32 experts, top-4, RMSNorm in
the latent, one shared expert) whose selection bias is balanced without an auxiliary loss by the
quantile rule below, SiTU-GLU everywhere, a dense first layer. It is exported in the released K3
checkpoint layout (multimodal wrapper config with text_config, tensors prefixed language_model.,
two safetensors shards + index, routed experts in MXFP4 "mxfp4-pack-quantized"), so it exercises
the loader users use.

Quantile balancing (our rule; the design names it without defining it): after every step, for
each MoE layer and expert e, q_e is the (1 - k/E) quantile of that expert's sigmoid score over
the step's tokens; the selection bias moves toward b*_e = mean(q) - q_e (b <- b + 0.1 (b* - b)).
With b = b*, every expert's biased score clears the common threshold mean(q) for a k/E share of
the tokens, which is what an even load needs; the bias is used for selection only (spec 8).

Modes:
  train.py --data DIR --out DIR [--minutes M]     train (DIR from scripts/train-data.py) and export
  train.py --check-golden test/golden/k3mx         this PyTorch model against the golden logits
                                                   (float64): checks the math before training
  train.py --ablation --data DIR                   load balance with and without the quantile rule

Needs torch (and numpy); matplotlib for the loss curve PNG when present. Run on a machine with
PyTorch and a GPU (the shipped model: `python3 scripts/train.py --data build/trainbin --out OUT/model
--minutes 6.3`, one H200); not needed to build or test moe."""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# safetensors, read and written here (no dependency beyond numpy)

DT = {"F32": (np.float32, 4), "F64": (np.float64, 8), "I32": (np.int32, 4), "I64": (np.int64, 8), "BF16": (np.uint16, 2), "U8": (np.uint8, 1), "F16": (np.float16, 2)}


def st_read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=DT[v["dtype"]][0]).reshape(v["shape"])
        out[k] = (v["dtype"], arr)
    return out


def bf16_to_f32(a):
    return (a.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a):  # round to nearest even
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def st_write(path, tensors):
    """tensors: name -> (dtype, numpy array of the stored type)"""
    head, blobs, off = {}, [], 0
    for k, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        head[k] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    head["__metadata__"] = {"format": "pt"}
    hj = json.dumps(head, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def mxfp4_dequant(packed, scale):
    lo, hi = packed & 15, packed >> 4
    q = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)
    s = np.exp2(scale.astype(np.float32) - 127.0)
    return E2M1[q] * np.repeat(s, 32, axis=1)


def mxfp4_quant(w):
    """w [out, in] float32 -> (packed U8 [out, in/2], scale U8 [out, in/32]); OCP MX rule: the block
    scale is 2^(floor(log2(amax)) - 2), each value rounded to the nearest E2M1 number."""
    o, i = w.shape
    blk = w.reshape(o, i // 32, 32)
    amax = np.abs(blk).max(axis=-1)
    e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2, -127).clip(-127, 127)
    sc = np.exp2(e)[..., None]
    x = blk / sc
    mags = E2M1[:8]
    idx = np.abs(np.abs(x)[..., None] - mags).argmin(-1)  # ties go to the smaller magnitude
    q = idx + 8 * (x < 0)
    q = q.reshape(o, i).astype(np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return packed, (e + 127).astype(np.uint8)


def mxfp4_fake(w):
    """the same rounding on a torch tensor, with a straight-through gradient (quantization-aware
    training of the routed experts in the last part of training)"""
    shp = w.shape
    blk = w.reshape(*shp[:-1], shp[-1] // 32, 32)
    amax = blk.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    sc = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    x = blk / sc
    mags = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], device=w.device, dtype=w.dtype)
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    qv = mags[idx] * torch.sign(x)
    q = (qv * sc).reshape(shp)
    return w + (q - w).detach()


# ---------------------------------------------------------------------------------------------
# the model (shared/spec/MODEL.md, section numbers in comments)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2n(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class Cfg:
    def __init__(self, tc):
        self.tc = tc
        self.V, self.d, self.L = tc["vocab_size"], tc["hidden_size"], tc["num_hidden_layers"]
        self.eps = tc["rms_norm_eps"]
        la = tc["linear_attn_config"]
        self.kda = set(la["kda_layers"])
        self.Hk, self.D, self.W, self.lb = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"], la["gate_lower_bound"]
        self.H, self.rq, self.r = tc["num_attention_heads"], tc["q_lora_rank"], tc["kv_lora_rank"]
        self.dn, self.dr, self.dv = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
        self.E, self.k, self.S, self.Ie = tc["num_experts"], tc["num_experts_per_token"], tc["num_shared_experts"], tc["moe_intermediate_size"]
        self.I, self.dl, self.scale = tc["intermediate_size"], tc["routed_expert_hidden_size"], tc["routed_scaling_factor"]
        self.G, self.Gk = tc.get("num_expert_group", 1), tc.get("topk_group", 1)
        self.dense_first = tc["first_k_dense_replace"]
        self.B = tc["attn_res_block_size"]
        self.beta, self.beta_lin = tc["activation_situ_beta"], tc["activation_situ_linear_beta"]


def glu(c, a, b):  # SiTU-GLU (spec 3)
    return c.beta * torch.tanh(a / c.beta) * torch.sigmoid(a) * (c.beta_lin * torch.tanh(b / c.beta_lin))


def kda_chunked(q, k, v, g, beta, C=16):
    """spec 6.1 on 16-token chunks (exact in exact arithmetic; the bounded gate keeps every factor
    finite in f32): intra-chunk parts for all chunks at once, then the state through the chunks."""
    Bn, T, H, D = q.shape
    pad = (-T) % C
    if pad:
        z = lambda x: F.pad(x, (0, 0, 0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, 0, 0, pad))
        q, k, v, g, beta = z(q), z(k), z(v), z(g), z(beta)
    N = q.shape[1] // C
    r = lambda x: x.reshape(Bn, N, C, H, -1).permute(0, 3, 1, 2, 4)  # [B, H, N, C, *]
    q, k, v, g = r(q), r(k), r(v), r(g)
    beta = beta.reshape(Bn, N, C, H).permute(0, 3, 1, 2).unsqueeze(-1)
    G = g.cumsum(-2)
    kG, kN, qG = k * torch.exp(G), k * torch.exp(-G), q * torch.exp(G)
    tril = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    A = (kG @ kN.transpose(-1, -2)) * beta
    A = A.masked_fill(tril.logical_not() | torch.eye(C, dtype=torch.bool, device=q.device), 0)
    P = (qG @ kN.transpose(-1, -2)).masked_fill(tril.logical_not(), 0)
    Lm = A + torch.eye(C, dtype=q.dtype, device=q.device)
    w = torch.linalg.solve_triangular(Lm, beta * kG, upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(Lm, beta * v, upper=False, unitriangular=True)
    kdec = k * torch.exp(G[..., -1:, :] - G)
    decay = torch.exp(G[..., -1, :]).unsqueeze(-1)  # [B, H, N, D, 1]
    S = q.new_zeros(Bn, H, D, v.shape[-1])
    outs = []
    for n in range(N):
        vn = u[:, :, n] - w[:, :, n] @ S
        outs.append(qG[:, :, n] @ S + P[:, :, n] @ vn)
        S = decay[:, :, n] * S + kdec[:, :, n].transpose(-1, -2) @ vn
    o = torch.stack(outs, 2)  # [B, H, N, C, D]
    return o.permute(0, 2, 3, 1, 4).reshape(Bn, N * C, H, -1)[:, :T]


class Model(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        P = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.02)
        O = lambda *s: torch.nn.Parameter(torch.ones(*s))
        Z = lambda *s: torch.nn.Parameter(torch.zeros(*s))
        d = c.d
        self.p = torch.nn.ParameterDict()
        p = self.p
        p["embed"] = P(c.V, d)
        p["norm"] = O(d)
        p["lm_head"] = P(c.V, d)
        p["out_res_norm"], p["out_res_proj"] = O(d), Z(1, d)
        self.bias = []
        for i in range(c.L):
            s = f"l{i}_"
            p[s + "in_norm"], p[s + "post_norm"] = O(d), O(d)
            p[s + "attn_res_norm"], p[s + "attn_res_proj"] = O(d), Z(1, d)
            p[s + "mlp_res_norm"], p[s + "mlp_res_proj"] = O(d), Z(1, d)
            if (i + 1) in c.kda:
                HD = c.Hk * c.D
                for n in ("q", "k", "v", "g"):
                    p[s + n] = P(HD, d)
                for n in ("qc", "kc", "vc"):
                    p[s + n] = torch.nn.Parameter(torch.randn(HD, 1, c.W) * 0.3)
                p[s + "fa"], p[s + "fb"] = P(c.D, d), P(HD, c.D)
                p[s + "A_log"] = torch.nn.Parameter(torch.log(torch.linspace(1, 4, c.Hk)))
                p[s + "dt_bias"] = Z(HD)
                p[s + "b"] = P(c.Hk, d)
                p[s + "o_norm"] = O(c.D)
                p[s + "o"] = P(d, HD)
            else:
                p[s + "q_a"], p[s + "q_a_norm"], p[s + "q_b"] = P(c.rq, d), O(c.rq), P(c.H * (c.dn + c.dr), c.rq)
                p[s + "kv_a"], p[s + "kv_a_norm"] = P(c.r + c.dr, d), O(c.r)
                p[s + "kv_b"] = P(c.H * (c.dn + c.dv), c.r)
                p[s + "g"], p[s + "o"] = P(c.H * c.dv, d), P(d, c.H * c.dv)
            if i < c.dense_first:
                p[s + "gate"], p[s + "up"], p[s + "down"] = P(c.I, d), P(c.I, d), P(d, c.I)
            else:
                p[s + "router"] = P(c.E, d)
                p[s + "w1"], p[s + "w3"], p[s + "w2"] = P(c.E, c.Ie, c.dl), P(c.E, c.Ie, c.dl), P(c.E, c.dl, c.Ie)
                p[s + "lat_down"], p[s + "lat_up"], p[s + "lat_norm"] = P(c.dl, d), P(d, c.dl), O(c.dl)
                p[s + "sh_gate"], p[s + "sh_up"], p[s + "sh_down"] = P(c.S * c.Ie, d), P(c.S * c.Ie, d), P(d, c.S * c.Ie)
                self.register_buffer(s + "bias", torch.zeros(c.E))
        self.fake_quant = False
        self.dense_dispatch = False
        self.loads = {}  # layer -> tokens per expert (last forward)
        self.scores = {}  # layer -> sigmoid router scores (last forward, for the bias rule)

    def kda(self, i, x):
        c, p, s = self.c, self.p, f"l{i}_"
        Bn, T, _ = x.shape

        def conv(u, w):
            y = F.conv1d(u.transpose(1, 2), w, groups=w.shape[0], padding=c.W - 1)[..., :T]
            return F.silu(y).transpose(1, 2)

        q = conv(x @ p[s + "q"].T, p[s + "qc"]).reshape(Bn, T, c.Hk, c.D)
        k = conv(x @ p[s + "k"].T, p[s + "kc"]).reshape(Bn, T, c.Hk, c.D)
        v = conv(x @ p[s + "v"].T, p[s + "vc"]).reshape(Bn, T, c.Hk, c.D)
        q, k = l2n(q) * c.D ** -0.5, l2n(k)
        f = ((x @ p[s + "fa"].T) @ p[s + "fb"].T + p[s + "dt_bias"]).reshape(Bn, T, c.Hk, c.D)
        g = c.lb * torch.sigmoid(torch.exp(p[s + "A_log"]).view(1, 1, -1, 1) * f)
        beta = torch.sigmoid(x @ p[s + "b"].T)
        o = kda_chunked(q, k, v, g, beta)
        og = (x @ p[s + "g"].T).reshape(Bn, T, c.Hk, c.D)
        o = rms(o, p[s + "o_norm"], c.eps) * torch.sigmoid(og)
        return o.reshape(Bn, T, -1) @ p[s + "o"].T

    def mla(self, i, x):
        c, p, s = self.c, self.p, f"l{i}_"
        Bn, T, _ = x.shape
        q = rms(x @ p[s + "q_a"].T, p[s + "q_a_norm"], 1e-6) @ p[s + "q_b"].T
        q = q.reshape(Bn, T, c.H, c.dn + c.dr)
        ckr = x @ p[s + "kv_a"].T
        cl, kr = ckr[..., : c.r], ckr[..., c.r:]
        kv = (rms(cl, p[s + "kv_a_norm"], 1e-6) @ p[s + "kv_b"].T).reshape(Bn, T, c.H, c.dn + c.dv)
        kn, v = kv[..., : c.dn], kv[..., c.dn:]
        k = torch.cat([kn, kr.unsqueeze(2).expand(Bn, T, c.H, c.dr)], -1)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=1.0 / math.sqrt(c.dn + c.dr))
        y = y.transpose(1, 2).reshape(Bn, T, c.H * c.dv) * torch.sigmoid(x @ p[s + "g"].T)
        return y @ p[s + "o"].T

    def ffn(self, i, x):
        c, p, s = self.c, self.p, f"l{i}_"
        if i < c.dense_first:
            return glu(c, x @ p[s + "gate"].T, x @ p[s + "up"].T) @ p[s + "down"].T
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        sc = torch.sigmoid((x @ p[s + "router"].T).float())
        sel = sc + getattr(self, s + "bias")
        if c.G > 1 and c.G > c.Gk:
            gs = sel.reshape(-1, c.G, c.E // c.G).topk(2, -1).values.sum(-1)
            keep = torch.zeros_like(gs, dtype=torch.bool).scatter(1, gs.topk(c.Gk, -1).indices, True)
            sel = sel.masked_fill(~keep.repeat_interleave(c.E // c.G, 1), float("-inf"))
        idx = sel.topk(c.k, -1).indices
        w = sc.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.scale
        self.scores[i] = sc.detach()
        self.loads[i] = torch.bincount(idx.flatten(), minlength=c.E).detach()
        xl = x @ p[s + "lat_down"].T
        W1, W3, W2 = p[s + "w1"], p[s + "w3"], p[s + "w2"]
        if self.fake_quant:
            W1, W3, W2 = mxfp4_fake(W1), mxfp4_fake(W3), mxfp4_fake(W2)
        if self.dense_dispatch:
            # training: every expert on every token (a few batched matmuls instead of a loop),
            # weighted by the routing weights, zero for the experts not chosen
            wt = torch.zeros(x.shape[0], c.E, device=x.device, dtype=xl.dtype).scatter(1, idx, w.to(xl.dtype))
            a1 = torch.einsum("nd,eid->nei", xl, W1)
            a3 = torch.einsum("nd,eid->nei", xl, W3)
            h = glu(c, a1, a3) * wt.unsqueeze(-1)
            y = torch.einsum("nei,edi->nd", h, W2)
        else:
            y = torch.zeros_like(xl)
            for e in range(c.E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                xe = xl[tok]
                hh = glu(c, xe @ W1[e].T, xe @ W3[e].T) @ W2[e].T
                y = y.index_add(0, tok, hh * w[tok, slot].unsqueeze(-1).to(hh.dtype))
        y = rms(y, p[s + "lat_norm"], c.eps) @ p[s + "lat_up"].T
        y = y + glu(c, x @ p[s + "sh_gate"].T, x @ p[s + "sh_up"].T) @ p[s + "sh_down"].T
        return y.reshape(shp)

    def attnres(self, pv, blocks, nw, pw):  # spec 5.2, mixing in f32
        V = torch.stack(blocks + [pv], 0).float()
        key = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + self.c.eps)
        s = (key * (nw * pw[0]).float()).sum(-1)
        a = torch.softmax(s, 0).unsqueeze(-1)
        return (a * V).sum(0).to(pv.dtype)

    def forward(self, ids):
        c, p = self.c, self.p
        h = p["embed"][ids]
        blocks, pv = [], h
        for i in range(c.L):
            s = f"l{i}_"
            xa = self.attnres(pv, blocks, p[s + "attn_res_norm"], p[s + "attn_res_proj"]) if blocks else pv
            if i % c.B == 0:
                blocks.append(pv)
                pv = None
            xn = rms(xa, p[s + "in_norm"], c.eps)
            a = self.kda(i, xn) if (i + 1) in c.kda else self.mla(i, xn)
            pv = a if pv is None else pv + a
            xm = self.attnres(pv, blocks, p[s + "mlp_res_norm"], p[s + "mlp_res_proj"])
            pv = pv + self.ffn(i, rms(xm, p[s + "post_norm"], c.eps))
        h = self.attnres(pv, blocks, p["out_res_norm"], p["out_res_proj"])
        return rms(h, p["norm"], c.eps) @ p["lm_head"].T

    @torch.no_grad()
    def balance(self, rate=0.1):
        """the quantile rule (module docstring)"""
        c = self.c
        for i, sc in self.scores.items():
            q = torch.quantile(sc[: 65536].float(), 1 - c.k / c.E, dim=0)
            b = getattr(self, f"l{i}_bias")
            b += rate * ((q.mean() - q) - b)


# ---------------------------------------------------------------------------------------------
# checkpoint names (K3 layout) <-> parameters

PFX = "language_model."


def names(c):
    """(our name, checkpoint name, stored dtype) for every tensor except the routed experts"""
    out = [("embed", "model.embed_tokens.weight", "BF16"), ("norm", "model.norm.weight", "BF16"), ("lm_head", "lm_head.weight", "BF16"),
           ("out_res_norm", "model.output_attn_res_norm.weight", "BF16"), ("out_res_proj", "model.output_attn_res_proj.weight", "BF16")]
    for i in range(c.L):
        s, t = f"l{i}_", f"model.layers.{i}."
        out += [(s + "in_norm", t + "input_layernorm.weight", "BF16"), (s + "post_norm", t + "post_attention_layernorm.weight", "BF16"),
                (s + "attn_res_norm", t + "self_attention_res_norm.weight", "BF16"), (s + "attn_res_proj", t + "self_attention_res_proj.weight", "BF16"),
                (s + "mlp_res_norm", t + "mlp_res_norm.weight", "BF16"), (s + "mlp_res_proj", t + "mlp_res_proj.weight", "BF16")]
        a = t + "self_attn."
        if (i + 1) in c.kda:
            out += [(s + "q", a + "q_proj.weight", "BF16"), (s + "k", a + "k_proj.weight", "BF16"), (s + "v", a + "v_proj.weight", "BF16"),
                    (s + "g", a + "g_proj.weight", "BF16"), (s + "qc", a + "q_conv1d.weight", "F32"), (s + "kc", a + "k_conv1d.weight", "F32"),
                    (s + "vc", a + "v_conv1d.weight", "F32"), (s + "fa", a + "f_a_proj.weight", "BF16"), (s + "fb", a + "f_b_proj.weight", "BF16"),
                    (s + "A_log", a + "A_log", "F32"), (s + "dt_bias", a + "dt_bias", "F32"), (s + "b", a + "b_proj.weight", "BF16"),
                    (s + "o_norm", a + "o_norm.weight", "F32"), (s + "o", a + "o_proj.weight", "BF16")]
        else:
            out += [(s + "q_a", a + "q_a_proj.weight", "BF16"), (s + "q_a_norm", a + "q_a_layernorm.weight", "BF16"),
                    (s + "q_b", a + "q_b_proj.weight", "BF16"), (s + "kv_a", a + "kv_a_proj_with_mqa.weight", "BF16"),
                    (s + "kv_a_norm", a + "kv_a_layernorm.weight", "BF16"), (s + "kv_b", a + "kv_b_proj.weight", "BF16"),
                    (s + "g", a + "g_proj.weight", "BF16"), (s + "o", a + "o_proj.weight", "BF16")]
        if i < c.dense_first:
            out += [(s + n, t + f"mlp.{n}_proj.weight", "BF16") for n in ("gate", "up", "down")]
        else:
            m = t + "block_sparse_moe."
            out += [(s + "router", m + "gate.weight", "BF16"), (s + "bias", m + "gate.e_score_correction_bias", "F32"),
                    (s + "lat_down", m + "routed_expert_down_proj.weight", "BF16"), (s + "lat_up", m + "routed_expert_up_proj.weight", "BF16"),
                    (s + "lat_norm", m + "routed_expert_norm.weight", "BF16"), (s + "sh_gate", m + "shared_experts.gate_proj.weight", "BF16"),
                    (s + "sh_up", m + "shared_experts.up_proj.weight", "BF16"), (s + "sh_down", m + "shared_experts.down_proj.weight", "BF16")]
    return out


def tensor_of(model, ours):
    return model.p[ours] if ours in model.p else getattr(model, ours)


@torch.no_grad()
def load_checkpoint(model, d, dtype):
    """weights of a K3-layout checkpoint directory into model (golden k3mx, or our own export)"""
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    files = {}
    for f in sorted(set(idx.values())):
        files.update(st_read(os.path.join(d, f)))
    c = model.c

    def get(name):
        dt, a = files[PFX + name]
        return bf16_to_f32(a) if dt == "BF16" else a.astype(np.float64)

    for ours, theirs, _ in names(c):
        a = get(theirs)
        t = tensor_of(model, ours)
        if ours.endswith("A_log"):
            a = a.reshape(-1)[: c.Hk]
        t.copy_(torch.from_numpy(np.asarray(a, dtype=np.float64)).reshape(t.shape).to(dtype))
    for i in range(c.dense_first, c.L):
        for wn in ("w1", "w2", "w3"):
            mats = []
            for e in range(c.E):
                base = PFX + f"model.layers.{i}.block_sparse_moe.experts.{e}.{wn}."
                if base + "weight_packed" in files:
                    mats.append(mxfp4_dequant(files[base + "weight_packed"][1], files[base + "weight_scale"][1]))
                else:
                    dt, a = files[base + "weight"]
                    mats.append(bf16_to_f32(a) if dt == "BF16" else a)
            model.p[f"l{i}_{wn}"].copy_(torch.from_numpy(np.stack(mats).astype(np.float64)).to(dtype))


def export(model, cfg_tc, out_dir):
    """the released K3 layout: wrapper config.json + 2 shards + index, MXFP4 routed experts"""
    os.makedirs(out_dir, exist_ok=True)
    c = model.c
    tensors = {}
    for ours, theirs, dt in names(c):
        a = tensor_of(model, ours).detach().float().cpu().numpy()
        tensors[PFX + theirs] = ("BF16", f32_to_bf16(a)) if dt == "BF16" else ("F32", a.astype(np.float32))
    for i in range(c.dense_first, c.L):
        for wn in ("w1", "w2", "w3"):
            W = model.p[f"l{i}_{wn}"].detach().float().cpu().numpy()
            for e in range(c.E):
                pk, sc = mxfp4_quant(W[e])
                base = PFX + f"model.layers.{i}.block_sparse_moe.experts.{e}.{wn}."
                tensors[base + "weight_packed"] = ("U8", pk)
                tensors[base + "weight_scale"] = ("U8", sc)
    keys = list(tensors)
    half = [k for k in keys if ".experts." in k]
    shards = {"model-00001-of-00002.safetensors": [k for k in keys if k not in set(half)],
              "model-00002-of-00002.safetensors": half}
    wm = {}
    total = 0
    for fn, ks in shards.items():
        st_write(os.path.join(out_dir, fn), {k: tensors[k] for k in ks})
        for k in ks:
            wm[k] = fn
            total += tensors[k][1].nbytes
    json.dump({"metadata": {"total_size": total}, "weight_map": wm}, open(os.path.join(out_dir, "model.safetensors.index.json"), "w"), indent=1)
    tc = dict(cfg_tc)
    tc["quantization_config"] = {
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None, "targets": ["Linear"],
                                      "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                                                  "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                                                  "symmetric": True, "type": "float", "zp_dtype": None}}},
        "format": "mxfp4-pack-quantized", "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                                                     "re:.*lm_head.*"],
        "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    wrapper = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "bos_token_id": tc["bos_token_id"],
               "eos_token_id": tc["eos_token_id"], "pad_token_id": tc["pad_token_id"], "tie_word_embeddings": False, "text_config": tc}
    json.dump(wrapper, open(os.path.join(out_dir, "config.json"), "w"), indent=2)


def text_config(n_base):
    return {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": n_base + 256, "hidden_size": 256,
            "num_hidden_layers": 8, "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "intermediate_size": 512,
            "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 4, "head_dim": 64,
                                   "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True, "mla_use_output_gate": True,
            "num_experts": 32, "num_experts_per_token": 4, "num_shared_experts": 1, "moe_intermediate_size": 128,
            "routed_expert_hidden_size": 128, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
            "routed_scaling_factor": 2.5, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "attn_res_block_size": 3, "tie_word_embeddings": False, "bos_token_id": n_base, "eos_token_id": n_base + 2,
            "pad_token_id": n_base + 255, "max_position_embeddings": 1048576}


# ---------------------------------------------------------------------------------------------


def check_golden(d):
    """this PyTorch model in float64 against the golden expected logits (all prompts, positions)"""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = json.load(open(os.path.join(d, "config.json")))
    c = Cfg(cfg.get("text_config", cfg))
    model = Model(c).double()
    load_checkpoint(model, d, torch.float64)
    cases = json.load(open(os.path.join(d, "cases.json")))
    ref = st_read(os.path.join(d, "logits.safetensors"))
    worst = 0.0
    for pcase in cases["prompts"]:
        ids = torch.tensor([pcase["ids"]])
        with torch.no_grad():
            lg = model(ids)[0].numpy()
        want = ref[pcase["logits_key"]][1].astype(np.float64).reshape(lg.shape)
        diff = float(np.abs(lg - want).max())
        worst = max(worst, diff)
        print(f"golden {os.path.basename(d)} {pcase['name']}: {len(pcase['ids'])} tokens, max |dlogit| {diff:.3g}, argmax equal "
              f"{bool((lg.argmax(-1) == want.argmax(-1)).all())}")
    print(f"golden check: worst {worst:.3g}")
    return worst


def train(a):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    data = np.fromfile(os.path.join(a.data, "train.bin"), dtype=np.uint16).astype(np.int64)
    valid = np.fromfile(os.path.join(a.data, "valid.bin"), dtype=np.uint16).astype(np.int64)
    n_base = sum(1 for _ in open(os.path.join(a.data, "tiktoken.model")))
    tc = text_config(n_base)
    c = Cfg(tc)
    torch.manual_seed(a.seed)
    model = Model(c).to(dev)
    model.dense_dispatch = True
    nparam = sum(p.numel() for p in model.parameters())
    print(f"model: {nparam / 1e6:.2f} M parameters, vocab {c.V}, train tokens {len(data)}")
    tdata, vdata = torch.from_numpy(data).to(dev), torch.from_numpy(valid).to(dev)
    decay = [p for n, p in model.p.items() if p.dim() >= 2 and n != "embed"]
    rest = [p for n, p in model.p.items() if not (p.dim() >= 2 and n != "embed")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    # the context curriculum: (sequence length, batch) stages over the time budget
    stages = [(256, 64, 0.5), (1024, 16, 0.3), (4096, 4, 0.2)]
    budget = a.minutes * 60
    t0 = time.time()
    log = []
    step = 0
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed)

    def batch(T, Bn, src):
        ix = torch.randint(0, len(src) - T - 1, (Bn,), device=dev, generator=gen)
        x = src[ix.unsqueeze(1) + torch.arange(T + 1, device=dev)]
        return x[:, :-1], x[:, 1:]

    @torch.no_grad()
    def evaluate(T=1024):
        model.eval()
        losses = []
        for j in range(0, min(len(vdata) - T - 1, 40 * T), T):
            x = vdata[j:j + T + 1].unsqueeze(0)
            losses.append(F.cross_entropy(model(x[:, :-1]).float().reshape(-1, c.V), x[:, 1:].reshape(-1)).item())
        model.train()
        return float(np.mean(losses))

    with torch.no_grad():  # the training dispatch computes what the exported (sparse) one does
        x, _ = batch(256, 4, tdata)
        model.dense_dispatch = False
        ref = model(x)
        model.dense_dispatch = True
        print(f"dense vs sparse expert dispatch: max |dlogit| {(model(x) - ref).abs().max().item():.3g}", flush=True)
    elapsed_before = 0.0
    for si, (T, Bn, frac) in enumerate(stages):
        stage_end = elapsed_before + frac * budget
        while time.time() - t0 < stage_end:
            el = time.time() - t0
            lr = a.lr * min(1.0, (step + 1) / 200) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, el / budget))))
            for g in opt.param_groups:
                g["lr"] = lr
            model.fake_quant = el > 0.85 * budget  # the last 15%: experts see their MXFP4 rounding
            x, y = batch(T, Bn, tdata)
            loss = F.cross_entropy(model(x).float().reshape(-1, c.V), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if a.balance:
                model.balance()
            if step % 25 == 0:
                loads = torch.stack([l.float() for l in model.loads.values()])
                imb = (loads.max(1).values / loads.mean(1)).mean().item()
                log.append({"step": step, "seconds": round(el, 1), "seq": T, "loss": round(loss.item(), 4), "lr": lr, "load_max_over_mean": round(imb, 3)})
                if step % 500 == 0:
                    print(json.dumps(log[-1]), flush=True)
            step += 1
        elapsed_before += frac * budget
        v = evaluate()
        log.append({"step": step, "seconds": round(time.time() - t0, 1), "seq": T, "valid_loss": round(v, 4), "stage_end": si})
        print(json.dumps(log[-1]), flush=True)
    return model, tc, log


@torch.no_grad()
def load_stats(model, vdata, T=1024):
    """tokens per expert over the held-out text: max / mean, per MoE layer"""
    c = model.c
    tot = {i: torch.zeros(c.E, device=vdata.device) for i in range(c.dense_first, c.L)}
    for j in range(0, min(len(vdata) - T - 1, 20 * T), T):
        model(vdata[j:j + T].unsqueeze(0))
        for i, l in model.loads.items():
            tot[i] += l.float()
    return {i: round((t.max() / t.mean()).item(), 3) for i, t in tot.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data")
    ap.add_argument("--out")
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-balance", dest="balance", action="store_false")
    ap.add_argument("--check-golden", action="append", default=[])
    ap.add_argument("--ablation", action="store_true")
    a = ap.parse_args()
    for d in a.check_golden:
        w = check_golden(d)
        if w > 1e-3:
            sys.exit(f"golden check failed on {d}: {w}")
    if a.ablation:
        res = {}
        for bal in (True, False):
            a.balance = bal
            model, tc, log = train(a)
            v = torch.from_numpy(np.fromfile(os.path.join(a.data, "valid.bin"), dtype=np.uint16).astype(np.int64)).to(next(model.parameters()).device)
            model.dense_dispatch = False
            res["quantile" if bal else "none"] = {"load_max_over_mean": load_stats(model, v), "final": log[-1]}
            print(json.dumps(res), flush=True)
        os.makedirs(a.out, exist_ok=True)
        json.dump(res, open(os.path.join(a.out, "ablation.json"), "w"), indent=1)
        return
    if not a.data:
        return
    model, tc, log = train(a)
    os.makedirs(a.out, exist_ok=True)
    json.dump(log, open(os.path.join(a.out, "train_log.json"), "w"), indent=0)
    model.fake_quant = False
    model.dense_dispatch = False
    export(model, tc, a.out)
    # the exported model reloaded (bf16 dense, MXFP4 experts) gives the reference logits that
    # moe must reproduce; and its held-out loss and expert loads
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = next(model.parameters()).device
    load_checkpoint(model, a.out, torch.float32)
    v = torch.from_numpy(np.fromfile(os.path.join(a.data, "valid.bin"), dtype=np.uint16).astype(np.int64)).to(dev)
    with torch.no_grad():
        ids = v[:64].unsqueeze(0)
        lg = model(ids)[0].float().cpu().numpy()
        losses = [F.cross_entropy(model(v[j:j + 1025][None, :-1]).float()[0], v[j + 1:j + 1025]).item() for j in range(0, 40 * 1024, 1024)]
    np.array(ids[0].cpu().numpy(), dtype=np.int32).tofile(os.path.join(a.out, "ref_ids.bin"))
    lg.astype(np.float32).tofile(os.path.join(a.out, "ref_logits.bin"))
    stats = {"exported_valid_loss": float(np.mean(losses)), "exported_valid_ppl": float(np.exp(np.mean(losses))),
             "load_max_over_mean": load_stats(model, v), "parameters": sum(p.numel() for p in model.parameters())}
    json.dump(stats, open(os.path.join(a.out, "train_stats.json"), "w"), indent=1)
    print(json.dumps(stats))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        tr = [r for r in log if "loss" in r]
        va = [r for r in log if "valid_loss" in r]
        plt.figure(figsize=(7, 4))
        plt.plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train loss")
        plt.plot([r["step"] for r in va], [r["valid_loss"] for r in va], "o-", label="held-out loss")
        for r in va:
            plt.annotate(f"ctx {r['seq']}", (r["step"], r["valid_loss"]))
        plt.xlabel("step")
        plt.ylabel("cross-entropy (nats/token)")
        plt.legend()
        plt.title("moe small K3-architecture model")
        plt.tight_layout()
        plt.savefig(os.path.join(a.out, "loss.png"), dpi=90)
    except ImportError:
        print("no matplotlib: loss.png not drawn")


if __name__ == "__main__":
    main()
