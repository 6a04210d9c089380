"""bench.kernel_split sorts kernels by their library names and counts idle time as wall time less device time."""

from types import SimpleNamespace

from torch.autograd import DeviceType

from bench.kernel_split import describe_split, kernel_kind, kernel_split


def test_kernel_names_sort_into_kinds():
    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "GEMM"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "GEMM"
    assert kernel_kind("cutlass::device_kernel<GemmUniversal<GroupProblemShape<...>>>") == "grouped GEMM"
    assert kernel_kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert kernel_kind("chunk_kda_fwd_kernel_intra_sub_chunk") == "KDA"
    assert kernel_kind("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "KDA"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>") == \
        "row-wise"


def test_idle_is_wall_time_less_device_time():
    def event(key, us, device=DeviceType.CUDA):
        return SimpleNamespace(key=key, self_device_time_total=us, device_type=device)

    prof = SimpleNamespace(key_averages=lambda: [event("nvjet_x", 300_000), event("flash_fwd", 100_000),
                                                 event("rmsnorm_fwd", 50_000), event("aten::mm", 1, DeviceType.CPU)])
    split = kernel_split(prof, wall_s=0.6)
    assert split["GEMM"][0] == 0.3 and split["attention"][0] == 0.1 and split["row-wise"][0] == 0.05
    assert abs(split["idle"][0] - 0.15) < 1e-12
    assert "GEMM 0.300 s (50%)" in describe_split(split)
