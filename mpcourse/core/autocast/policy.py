"""The autocast op policy as data: which ops run in lower precision, which in FP32, which promote.

This file is a transcription of PyTorch's own lists, for the torch version the course pins (2.13):

* CPU: the ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`` block of ``aten/src/ATen/autocast_mode.cpp``.
* CUDA: the ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
  ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` and ``AT_FORALL_PROMOTE`` macros of
  ``aten/src/ATen/autocast_mode.h`` plus the extra ``KERNEL_CUDA`` lines and the banned
  ``binary_cross_entropy`` of ``autocast_mode.cpp`` (``TORCH_LIBRARY_IMPL(aten, Autocast, m)``).

Entries are aten operator names, ``name`` or ``name.overload``, exactly as the dispatcher registers
them (``torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + entry, "AutocastCPU")`` is True for
every CPU entry; ``tests/core/autocast/test_autocast.py`` checks that each table equals the registered set).

The policies (``CastPolicy`` in ``autocast_mode.h``):

* ``lower_precision_fp``: cast every eligible floating input to the region's dtype (bf16/fp16), run.
  Matmuls and convolutions: tensor cores multiply low-precision operands exactly and accumulate in
  FP32, so they lose little and gain a lot.
* ``fp32``: cast every eligible input to FP32, run. Ops that need range or precision: exp/log/pow,
  norms and their statistics, losses, reductions over many terms, linear algebra, FFTs.
* ``fp32_set_opt_dtype``: ops with an optional ``dtype=`` argument (softmax, sum, cumsum, ...). If the
  caller gave a dtype, run unchanged; else if the first input is eligible, run with ``dtype=float32``
  (the op upcasts internally); else run unchanged.
* ``fp32_append_dtype``: ``norm`` overloads without a dtype: rerun as the overload with
  ``dtype=float32`` (or the input's own dtype when the input is not eligible).
* ``promote``: ops that mix several floating inputs (cat, stack, addcmul, ...): cast every eligible
  input to the widest of their dtypes (FP32 if any is FP32, else the region's dtype).
* ``banned``: raise (``binary_cross_entropy`` on CUDA: use ``binary_cross_entropy_with_logits``).

Anything not listed runs in the dtype of its inputs (element-wise ops, views, embedding, dropout,
masked_fill, and on CPU also softmax, layer_norm, exp, log, sum).

Why the CPU and CUDA lists differ: the CUDA list was written for FP16 (default dtype there), whose
range ends at 65504: exp, log, pow, softmax, sums and norms overflow or lose small terms in FP16, so
they are forced to FP32. The CPU list was written for BF16 (default dtype there), which has FP32's
8 exponent bits and so FP32's range: it leaves those ops in the input dtype (their CPU kernels
accumulate in FP32 internally) and forces to FP32 the linear algebra, FFTs, 3-D pooling/padding and
the losses. The CPU list applies unchanged with ``dtype=torch.float16``.

Eligible input (``is_eligible`` in ``autocast_mode.h``): a floating tensor on the region's device
type that is not float64. Only out-of-place ops are listed: ``add_``, ``out=`` variants run unchanged.

Composites: some Python-visible ops are not registered but are C++ compositions that call a listed
op; ``torch.autocast`` (a dispatcher key) sees the inner call, a Python mode sees only the outer one.
``COMPOSITES`` maps those we handle to the listed op whose policy applies; see ``mode.py``.

Where the course's table departs from torch's: ``ADDITIONS``, ops torch 2.13 lists for no device type but the
course gives a policy, one entry so far.

* ``_grouped_mm`` (``torch._grouped_mm``; ``F.grouped_mm`` is its Python wrapper): the grouped GEMM of
  mixture-of-experts layers, one GEMM per expert over a jagged slice of the tokens. The course gives it the
  policy of ``mm``/``bmm``, ``lower_precision_fp``, on both device types: it *is* those GEMMs (on CPU, and on
  a GPU without the grouped kernel, ATen's fallback runs ``mm_out`` per group, or ``bmm_out`` for two 3-D
  operands; ``aten/src/ATen/native/GroupedMMUtils.h``). torch.autocast leaves it unlisted, so it runs on its
  inputs' dtypes, and the usual mix under autocast, an FP32 activation (a norm's output) meeting BF16 expert
  weights, raises a dtype mismatch: an open PyTorch bug ("torch._grouped_mm is not autocast-compatible";
  MoE code works around it by casting the input to the weights' dtype by hand). Under the course's autocast the call
  runs as those hand-made casts would (tested bit for bit, and against torch.autocast's own ``bmm``/``mm`` on
  the same inputs). Two consequences to know: inputs that are all FP32 are cast too (torch runs them in FP32),
  and a cast to a 2-byte dtype halves the byte strides, which the op wants in multiples of 16 bytes (an FP32
  operand with 4 columns passes, its BF16 copy does not: pad K and N to multiples of 8). On CPU, torch 2.13
  runs it for float32, bfloat16 and float16; a 2-D operand needs int32 offsets (``offs``), two 3-D operands
  take none; ``out_dtype`` must equal the first operand's dtype.

torch's behaviour stays reachable: ``policy_for(..., course_additions=False)`` looks up torch's tables alone,
and ``autocast(..., course_additions=False)`` applies them (the mixed-dtype grouped GEMM then raises as under
``torch.autocast``). ``TABLES`` itself stays the transcription of torch's registrations (the table tests
compare it with them); a test fails when torch registers an autocast kernel for an addition, which then goes.
"""
from __future__ import annotations

LOWER_PRECISION_FP = "lower_precision_fp"
FP32 = "fp32"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
FP32_APPEND_DTYPE = "fp32_append_dtype"
PROMOTE = "promote"
BANNED = "banned"

POLICIES = (LOWER_PRECISION_FP, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED)

DEVICE_TYPES = ("cpu", "cuda")

# The torch release these tables were transcribed from (the lists change between releases; the table
# tests compare them with the installed torch and name this version when they disagree).
TORCH_VERSION = "2.13"


def _ops(text: str) -> tuple[str, ...]:
    """Split a whitespace-separated list of aten op names into a tuple."""
    return tuple(text.split())


# --- CPU (AutocastCPU; autocast_mode.cpp) ---------------------------------------------------------
CPU = {
    LOWER_PRECISION_FP: _ops("""
        conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding
        bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm linear
        _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer
        conv_transpose1d conv_transpose2d.input conv_transpose3d.input
        prelu scaled_dot_product_attention _native_multi_head_attention
    """),
    FP32: _ops("""
        avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int
        quantile quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist
        grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex
        cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse
        max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d
        reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d replication_pad3d
        mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss
        smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div
        multilabel_margin_loss binary_cross_entropy_with_logits
        fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft
        fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft
        linalg_cond linalg_cond.p_str linalg_matrix_rank linalg_matrix_rank.tol_tensor
        linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.atol_rtol_float
        linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
        linalg_householder_product linalg_tensorinv linalg_tensorsolve
        fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve
        fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
        multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
        linalg_eigh linalg_lstsq linalg_inv_ex
    """),
    FP32_SET_OPT_DTYPE: (),
    FP32_APPEND_DTYPE: (),
    PROMOTE: _ops("stack cat index_copy"),
    BANNED: (),
}

# --- CUDA (Autocast; autocast_mode.h macros + autocast_mode.cpp) ---------------------------------
CUDA = {
    LOWER_PRECISION_FP: _ops("""
        _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc
        conv_transpose1d conv_transpose2d.input conv_transpose3d.input convolution prelu
        addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
        chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell
        lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
        _scaled_dot_product_flash_attention scaled_dot_product_attention
        cudnn_convolution cudnn_convolution_transpose
    """),
    FP32: _ops("""
        acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
        pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus
        layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim
        nuclear_norm nuclear_norm.dim cosine_similarity
        poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
        l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
        soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
        dist pdist cdist renorm logsumexp
        upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d
        upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
        _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
    """),
    FP32_SET_OPT_DTYPE: _ops("""
        prod prod.dim_int softmax.int log_softmax.int cumprod cumsum
        linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList
    """),
    FP32_APPEND_DTYPE: _ops("norm.Scalar norm.ScalarOpt_dim"),
    PROMOTE: _ops("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"),
    BANNED: _ops("binary_cross_entropy"),
}

TABLES = {"cpu": CPU, "cuda": CUDA}

# Python-visible composites that are not registered themselves but whose C++ body starts with (or
# consists of) calls to a listed op, so torch.autocast applies that op's policy. name -> listed op.
COMPOSITES = {
    "cpu": {
        "nll_loss_nd": "nll_loss",          # F.nll_loss -> aten::nll_loss_nd -> nll_loss / nll_loss2d
        "tensordot": "mm",                  # reshape both operands, one mm
        "linalg_multi_dot": "mm",           # a chain of mm
        "chain_matmul": "mm",
    },
    "cuda": {
        "nll_loss_nd": "nll_loss",
        # F.cross_entropy -> aten::cross_entropy_loss -> log_softmax (fp32_set_opt_dtype) + nll_loss
        # (fp32): the input is upcast first, every later step is FP32.
        "cross_entropy_loss": "nll_loss",
    },
}

# The course's additions to torch's tables (see the module docstring): device type -> {policy: entries}. Each entry
# is an aten op with no autocast kernel in torch 2.13 (tests/core/autocast/test_autocast.py checks that it still has none).
ADDITIONS = {
    "cpu": {LOWER_PRECISION_FP: _ops("_grouped_mm")},
    "cuda": {LOWER_PRECISION_FP: _ops("_grouped_mm")},
}

# Known gaps, documented rather than guessed: composites whose inner calls depend on the arguments.
# torch.einsum on CPU reaches bmm only when two operands share a summed index ("bij,bjk->bik" runs in
# BF16, "i,j->ij" stays FP32, and indices summed out of one operand are summed in FP32 before the
# bmm); torch.linalg.matrix_power reaches matmul only for n >= 2; F.pad reaches the CPU-listed
# reflection/replication pads only for those modes. The Python policy leaves these unlisted.
KNOWN_GAPS = {"cpu": ("einsum", "matrix_power", "linalg_matrix_power", "inner", "pad"), "cuda": ("pad",)}


# Refused rather than left to differ: the RNN family. torch.autocast reaches these ops' insides from
# C++ (on CPU nn.LSTM runs mkldnn_rnn_layer in the region's dtype, RNN/RNNCell run their linears in
# it and return it, GRU/GRUCell/LSTMCell run low-precision GEMMs but return FP32; on CUDA _cudnn_rnn
# is lower_precision_fp), where a Python mode sees only the outer call. Running them in FP32 would
# differ silently from torch.autocast in values and gradients, so mode.py raises, naming the ways out.
UNSUPPORTED = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")


def base_name(entry: str) -> str:
    """``"softmax.int"`` -> ``"softmax"``: the op name without its overload."""
    return entry.split(".", 1)[0]


def _index(table: dict) -> dict[str, str]:
    index: dict[str, str] = {}
    for policy, entries in table.items():
        for entry in entries:
            name = base_name(entry)
            if index.setdefault(name, policy) != policy:
                raise AssertionError(f"{name} has overloads under two policies")
    return index


# Policy by base op name, per device type: torch's (the tables and their composites), and the course's (those
# plus ADDITIONS), which mode.py looks up (all overloads share a policy).
TORCH_POLICY_BY_NAME = {dev: _index(table) for dev, table in TABLES.items()}
for _dev, _composites in COMPOSITES.items():
    for _name, _inner in _composites.items():
        TORCH_POLICY_BY_NAME[_dev].setdefault(_name, TORCH_POLICY_BY_NAME[_dev][_inner])
POLICY_BY_NAME = {dev: dict(index) for dev, index in TORCH_POLICY_BY_NAME.items()}
for _dev, _added in ADDITIONS.items():
    for _name, _policy in _index(_added).items():
        if POLICY_BY_NAME[_dev].setdefault(_name, _policy) != _policy:
            raise AssertionError(f"{_name} is in torch's {_dev} table and in ADDITIONS")


def policy_for(device_type: str, op_name: str, course_additions: bool = True) -> str | None:
    """The cast policy autocast applies to aten op ``op_name`` on ``device_type``.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        op_name: an aten op name, with or without overload (``"softmax"``, ``"softmax.int"``).
        course_additions: include the course's ``ADDITIONS`` (default); False: torch's tables alone.

    Returns:
        One of ``POLICIES``, or None for an unlisted op (it runs in its inputs' dtype).

    Raises:
        ValueError: an unknown device type.
    """
    if device_type not in POLICY_BY_NAME:
        raise ValueError(f"no autocast table for device_type={device_type!r}; use one of {DEVICE_TYPES}")
    index = POLICY_BY_NAME if course_additions else TORCH_POLICY_BY_NAME
    return index[device_type].get(base_name(op_name))


def ops_with_policy(device_type: str, policy: str, course_additions: bool = True) -> tuple[str, ...]:
    """The table entries (``name[.overload]``) of ``device_type`` under ``policy``, in source order, then the
    course's ``ADDITIONS`` under it (``course_additions=False``: torch's table alone)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; use one of {POLICIES}")
    if device_type not in TABLES:
        raise ValueError(f"no autocast table for device_type={device_type!r}; use one of {DEVICE_TYPES}")
    added = ADDITIONS[device_type].get(policy, ()) if course_additions else ()
    return TABLES[device_type][policy] + added
