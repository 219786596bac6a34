"""CUDA's and CPU's autocast op lists, as PyTorch's C++ sources register them (torch-free).

``autocast_policy.py`` applies the CUDA policy on the CPU key wherever the two differ.
"""

from __future__ import annotations

LOWER = "lower_precision_fp"
FP32 = "fp32"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
FP32_APPEND_DTYPE = "fp32_append_dtype"
PROMOTE = "promote"
NONE = "none"  # no kernel on that key: the op runs in its input dtypes
BANNED = "banned"  # the key's kernel raises (CUDA's binary_cross_entropy)


def _ops(policy: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), policy)


# Read from pytorch/pytorch aten/src/ATen/autocast_mode.h @ d70fe7f33910 (the
# AT_FORALL_{LOWER_PRECISION_FP,FP32,FP32_SET_OPT_DTYPE,DIFFERENT_REDISPATCH_SIGNATURE,
# PROMOTE} lists) and aten/src/ATen/autocast_mode.cpp @ 008ec6b1840c (the CUDA key adds
# cudnn_convolution{,_transpose} and bans binary_cross_entropy). Checked against the
# installed torch 2.14.1 (git 5c4886908584) dispatcher and by running its CUDA kernels
# on fake CUDA tensors: 2.14.1 also registers rms_norm and linalg_matrix_sqrth (fp32) and
# _cudnn_rnn (casts to fp16 in cudnn/AutocastRNN.cpp), and no longer has the Dimname
# overloads, which stay listed here but are skipped at registration.
CUDA_POLICY: dict[str, str] = {
    **_ops(
        LOWER,
        """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
        conv_transpose2d.input conv_transpose3d.input convolution cudnn_convolution
        cudnn_convolution_transpose prelu addmm addmv addr matmul einsum mm mv linalg_vecdot
        linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
        _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
        _scaled_dot_product_flash_attention scaled_dot_product_attention _cudnn_rnn""",
    ),
    **_ops(
        FP32,
        """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
        pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
        group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity
        poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
        kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
        multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
        binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
        upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
        _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d
        upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
        upsample_bicubic2d _upsample_bicubic2d_aa rms_norm linalg_matrix_sqrth""",
    ),
    **_ops(
        FP32_SET_OPT_DTYPE,
        """prod prod.dim_int prod.dim_Dimname softmax.int softmax.Dimname log_softmax.int
        log_softmax.Dimname cumprod cumprod.dimname cumsum cumsum.dimname linalg_vector_norm
        linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList
        sum.dim_DimnameList""",
    ),
    **_ops(FP32_APPEND_DTYPE, "norm.Scalar norm.ScalarOpt_dim norm.names_ScalarOpt_dim"),
    **_ops(
        PROMOTE,
        """addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
        scatter_add""",
    ),
}
CUDA_BANNED: frozenset[str] = frozenset({"binary_cross_entropy"})

# The AutocastCPU block of the same autocast_mode.cpp; 2.14.1 adds linalg_matrix_sqrth
# (fp32 by probe) and has dropped cholesky, qr and the Dimname overloads.
CPU_POLICY: dict[str, str] = {
    **_ops(
        LOWER,
        """conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm
        linalg_vecdot baddbmm addmm _addmm_activation addbmm linear _convolution.deprecated
        matmul conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d.input
        conv_transpose3d.input prelu scaled_dot_product_attention
        _native_multi_head_attention""",
    ),
    **_ops(
        FP32,
        """avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int
        prod.dim_Dimname quantile quantile.scalar nanquantile nanquantile.scalar stft
        stft.center cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d
        trace view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr
        ormqr pinverse max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d
        reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
        replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d
        hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss
        huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss multi_margin_loss
        ctc_loss.IntList ctc_loss.Tensor kl_div multilabel_margin_loss
        binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn
        fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft
        fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank
        linalg_matrix_rank.tol_tensor linalg_matrix_rank.atol_rtol_tensor
        linalg_matrix_rank.atol_rtol_float linalg_solve linalg_cholesky linalg_svdvals
        linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product
        linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf
        _lu_with_info qr svd triangular_solve fractional_max_pool2d fractional_max_pool3d
        adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex
        linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex linalg_matrix_sqrth""",
    ),
    **_ops(PROMOTE, "stack cat index_copy index_copy.dimname"),
}
