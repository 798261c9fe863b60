"""perf/attention_backends.py beyond SDPA: flex's block mask and forward (CPU), the dispatch, FA3's
argument wiring through a fake interface, its loader's errors and hash check, the record start-up check,
and flex/FA3 against SDPA on a GPU (gpu marker)."""
import hashlib
import sys
import types

import pytest
import torch

from perf import attention_backends as ab
from perf.backend import Backend, use_backend

RECORD_BACKEND = Backend(device="cuda", sm=90, triton=True, fp8=True, attention="fa3", compile=True,
                         cuda_graphs=True)


def _cu_seqlens(cuts, T, pad=1):
    return torch.tensor([0, *cuts, T] + [T] * pad, dtype=torch.int32)


def _qkv(T, H, dqk, dv, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(T, H, d, generator=gen, device=device).to(dtype) for d in (dqk, dqk, dv)]


@pytest.mark.parametrize("window", [0, 3, 7, 40])
def test_flex_block_mask_is_the_dense_mask(window):
    T, block = 64, 16
    cu = _cu_seqlens([5, 23, 24, 50], T)
    block_mask = ab.flex_block_mask(cu, T, window, block_size=block)
    dense = ab.varlen_attention_mask(cu, T, window)  # (T, T), the SDPA path's mask
    idx = torch.arange(T)
    per_element = block_mask.mask_mod(0, 0, idx[:, None], idx[None, :])
    assert torch.equal(per_element, dense)
    # a block is visited iff some (query, key) pair in it may attend
    touched = dense.reshape(T // block, block, T // block, block).any(dim=3).any(dim=1)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), touched)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # CPU: the eager reference
@pytest.mark.parametrize("paired", [False, True])
def test_flex_forward_matches_sdpa_on_cpu(paired):
    T, H, dqk, dv, window = 40, 6, 8, 16, 9  # unequal q/k and v widths, as the narrow layers
    q, k, v = _qkv(T, H, dqk, dv)
    cu = _cu_seqlens([7, 30], T, pad=2)
    want = ab.sdpa_varlen_attention(q, k, v, cu, window, 0.35, paired=paired)
    got = ab.flex_varlen_attention(q, k, v, cu, window, 0.35, paired=paired)
    assert got.shape == (T, H, dv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _fake_fa3(calls):
    """A flash_attn_varlen_func that checks FA3's calling convention and computes the rule from its
    arguments alone (segments from cu_seqlens_q, window from window_size), on the SDPA path."""

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, window_size):
        calls.append(dict(n=q.shape[0], heads=q.shape[1], max_seqlen=max_seqlen_q, window_size=window_size))
        assert causal and torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
        assert max_seqlen_q == max_seqlen_k >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert window_size[1] == 0
        out = ab.sdpa_varlen_attention(q, k, v, cu_seqlens_q, window_size[0], softmax_scale)
        return out, torch.zeros(q.shape[1], q.shape[0])  # (out, lse), as some builds return

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.mark.parametrize("paired", [False, True])
def test_fa3_wiring_through_a_fake_interface(monkeypatch, paired):
    calls = []
    monkeypatch.setattr(ab, "_fa3_interface", _fake_fa3(calls))
    T, H, window = 30, 6, 5
    q, k, v = _qkv(T, H, 8, 16, seed=1)
    cu = _cu_seqlens([11, 12], T)  # longest segment 18 tokens
    got = ab.fa3_varlen_attention(q, k, v, cu, window, 0.4, paired=paired)
    torch.testing.assert_close(got, ab.sdpa_varlen_attention(q, k, v, cu, window, 0.4, paired=paired))
    scale = 2 if paired else 1  # paired: twice the positions, half the heads, segments doubled
    assert calls == [dict(n=scale * T, heads=H // scale, max_seqlen=scale * 18, window_size=(window, 0))]
    ab.fa3_varlen_attention(q, k, v, cu, window, 0.4, paired=paired, max_seqlen=64)
    assert calls[-1]["max_seqlen"] == scale * 64  # the caller's bound, not read from cu_seqlens


def test_fa3_inside_compile_needs_max_seqlen(monkeypatch):
    calls = []
    monkeypatch.setattr(ab, "_fa3_interface", _fake_fa3(calls))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as dynamo sees it while tracing
    q, k, v = _qkv(8, 2, 4, 4)
    cu = _cu_seqlens([3], 8)
    with pytest.raises(ValueError, match="needs max_seqlen"):
        ab.fa3_varlen_attention(q, k, v, cu, 2, 1.0)
    ab.fa3_varlen_attention(q, k, v, cu, 2, 1.0, max_seqlen=8)
    assert calls[-1]["max_seqlen"] == 8


def test_dispatch_follows_the_backend(monkeypatch):
    calls = []
    for name in ("sdpa", "flex", "fa3"):
        monkeypatch.setattr(ab, f"{name}_varlen_attention", lambda *a, _n=name: calls.append((_n, len(a))) or _n)
    q = torch.zeros(4, 2, 8)
    cu = _cu_seqlens([], 4)
    for name in ("sdpa", "flex", "fa3"):
        with use_backend(attention=name):
            assert ab.varlen_attention(q, q, q, cu, 3, 1.0, paired=True, max_seqlen=4) == name
    assert calls == [("sdpa", 7), ("flex", 7), ("fa3", 8)]  # only FA3 takes max_seqlen


def test_load_fa3_without_the_kernels_package(monkeypatch):
    monkeypatch.setattr(ab, "_fa3_interface", None)
    monkeypatch.setitem(sys.modules, "kernels", None)  # import kernels -> ImportError
    with pytest.raises(RuntimeError, match="pip install kernels"):
        ab.load_fa3()


def _fake_kernels_package(monkeypatch, tmp_path, binary: bytes | None, fails: Exception | None = None):
    package_dir = tmp_path / "flash_attn3"
    package_dir.mkdir()
    if binary is not None:
        (package_dir / "_flash_attn3_cuda_abc123.abi3.so").write_bytes(binary)
    requests = []

    def get_kernel(repo, revision, trust_remote_code):
        requests.append((repo, revision))
        if fails:
            raise fails
        return types.SimpleNamespace(__file__=str(package_dir / "__init__.py"), flash_attn_interface="the interface")

    monkeypatch.setitem(sys.modules, "kernels", types.SimpleNamespace(get_kernel=get_kernel))
    monkeypatch.setattr(ab, "_fa3_interface", None)
    monkeypatch.delenv("SPEEDRUN_FA3_DIR", raising=False)  # the hub path, whatever the caller's shell says
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    return package_dir, requests


def test_load_fa3_names_the_network_when_the_hub_fails(monkeypatch, tmp_path):
    _, requests = _fake_kernels_package(monkeypatch, tmp_path, b"x", fails=OSError("offline"))
    with pytest.raises(RuntimeError, match="network access") as err:
        ab.load_fa3()
    assert ab.FA3_REPO in str(err.value) and "OSError: offline" in str(err.value)
    assert requests == [("devenpzak/flash-attn3-12864", "64c1e6d1f2780e7931839f41426ddcdb564a7cb9")]


def test_load_fa3_checks_the_binary_hash(monkeypatch, tmp_path):
    _fake_kernels_package(monkeypatch, tmp_path, b"not the pinned build")
    with pytest.raises(RuntimeError, match="refusing to run an unverified") as err:
        ab.load_fa3()
    assert hashlib.sha256(b"not the pinned build").hexdigest() in str(err.value)
    assert ab.FA3_BINARY_SHA256 in str(err.value) and ab._fa3_interface is None
    # the same file passes when it is what the pin says, and the interface is kept for later calls
    monkeypatch.setattr(ab, "FA3_BINARY_SHA256", hashlib.sha256(b"not the pinned build").hexdigest())
    assert ab.load_fa3() == "the interface" and ab._fa3_interface == "the interface"


def test_verify_fa3_binary_hand_hash_and_file_count(tmp_path):
    (tmp_path / "_flash_attn3_cuda_x.so").write_bytes(b"abc")
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256("abc"), FIPS 180-2
    assert ab.verify_fa3_binary(tmp_path, abc).name == "_flash_attn3_cuda_x.so"
    with pytest.raises(RuntimeError, match="has sha256 " + abc):
        ab.verify_fa3_binary(tmp_path, "0" * 64)
    (tmp_path / "_flash_attn3_cuda_y.so").write_bytes(b"abc")
    with pytest.raises(RuntimeError, match="exactly one"):
        ab.verify_fa3_binary(tmp_path, abc)
    with pytest.raises(RuntimeError, match="found none"):
        ab.verify_fa3_binary(tmp_path / "missing", abc)


def test_assert_record_backends(monkeypatch):
    cpu = Backend(device="cpu", sm=0, triton=False, fp8=True, attention="sdpa", compile=False)
    with pytest.raises(RuntimeError, match="a CUDA device.*FA3 attention.*torch.compile"):
        ab.assert_record_backends(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="interpreter"):
        ab.assert_record_backends(RECORD_BACKEND)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(ab, "_fa3_interface", None)
    monkeypatch.setitem(sys.modules, "kernels", None)
    with pytest.raises(RuntimeError, match="pip install kernels"):  # FA3 must load at start-up
        ab.assert_record_backends(RECORD_BACKEND)
    monkeypatch.setattr(ab, "_fa3_interface", "a verified interface")
    checked = []
    monkeypatch.setattr(ab, "check_fa3_compilable", checked.append)  # (tests/tools/test_tools_cross_compile.py)
    ab.assert_record_backends(RECORD_BACKEND)  # the fast path with FA3 loaded: no error
    assert checked == ["a verified interface"]  # and its ops trace under torch.compile


@pytest.mark.gpu
@pytest.mark.parametrize("paired", [False, True])
def test_flex_and_fa3_match_sdpa_on_gpu(paired):
    T, H, window = 1000, 6, 256
    q, k, v = (t.requires_grad_() for t in _qkv(T, H, 64, 128, device="cuda", dtype=torch.bfloat16))
    cu = _cu_seqlens([100, 130, 700], T).cuda()
    grad = torch.randn(T, H, 128, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        y = fn(q, k, v, cu, window, 0.12, paired=paired)
        return [y.float()] + [g.float() for g in torch.autograd.grad(y, (q, k, v), grad)]

    want = run(ab.sdpa_varlen_attention)
    backends = [ab.flex_varlen_attention]
    try:
        ab.load_fa3()
        backends.append(ab.fa3_varlen_attention)
    except RuntimeError:  # no hub access on this machine: tools/gpu_check.py reports FA3 separately
        pass
    for fn in backends:
        for got, ref in zip(run(fn), want):
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)  # bf16 attention, different orders


# ------------------------------------------------------------------------------------------------
# FA3 from a local directory (SPEEDRUN_FA3_DIR / LOCAL_KERNELS) and the hub's failure messages

FAKE_BINARY = b"a fake FA3 binary"


def _fake_fa3_dir(root, binary: bytes = FAKE_BINARY, variant: str | None = None):
    """A hub-layout package: [build/<variant>/]flash_attn3/{__init__.py, _flash_attn3_cuda_fake.so}.
    Its __init__ writes a marker, so a test sees whether its code ran."""
    package = (root / "build" / variant / "flash_attn3") if variant else (root / "flash_attn3")
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(root / 'imported')!r}, 'w').close()\n"
                                         "from ._interface import flash_attn_interface\n")
    (package / "_interface.py").write_text("flash_attn_interface = object()\n")  # a relative import resolves
    (package / "_flash_attn3_cuda_fake.so").write_bytes(binary)
    return package


def test_fa3_variant_names_the_hub_build():
    assert ab.fa3_variant("2.10.0+cu128", "12.8", "x86_64") == "torch210-cxx11-cu128-x86_64-linux"  # record #360's
    assert ab.fa3_variant("2.13.0+cpu", None, "x86_64") == "torch213-cxx11-cpu-x86_64-linux"


@pytest.mark.parametrize("layout", ["package", "build tree"])
def test_load_fa3_from_a_local_dir(monkeypatch, tmp_path, layout):
    variant = ab.fa3_variant() if layout == "build tree" else None
    package = _fake_fa3_dir(tmp_path, variant=variant)
    monkeypatch.setattr(ab, "_fa3_interface", None)
    monkeypatch.setitem(sys.modules, "kernels", None)  # a local dir never needs the kernels package
    monkeypatch.setenv("SPEEDRUN_FA3_DIR", str(package if layout == "package" else tmp_path))
    monkeypatch.setattr(ab, "FA3_BINARY_SHA256", hashlib.sha256(FAKE_BINARY).hexdigest())
    interface = ab.load_fa3()
    assert type(interface) is object and ab._fa3_interface is interface
    assert (tmp_path / "imported").exists()


def test_load_fa3_refuses_a_local_dir_with_the_wrong_hash(monkeypatch, tmp_path):
    package = _fake_fa3_dir(tmp_path)
    monkeypatch.setattr(ab, "_fa3_interface", None)
    monkeypatch.setenv("SPEEDRUN_FA3_DIR", str(package))
    with pytest.raises(RuntimeError, match="refusing to run an unverified") as err:
        ab.load_fa3()
    text = str(err.value)
    assert str(package / "_flash_attn3_cuda_fake.so") in text  # the file
    assert ab.FA3_BINARY_SHA256 in text and hashlib.sha256(FAKE_BINARY).hexdigest() in text  # expected, found
    assert not (tmp_path / "imported").exists() and ab._fa3_interface is None  # its code never ran


def test_load_fa3_honours_the_kernels_local_mapping(monkeypatch, tmp_path):
    package = _fake_fa3_dir(tmp_path)
    monkeypatch.setattr(ab, "_fa3_interface", None)
    monkeypatch.delenv("SPEEDRUN_FA3_DIR", raising=False)
    monkeypatch.setenv("LOCAL_KERNELS", f"someone/other=/nowhere:{ab.FA3_REPO}={package}")
    monkeypatch.setattr(ab, "FA3_BINARY_SHA256", hashlib.sha256(FAKE_BINARY).hexdigest())
    assert type(ab.load_fa3()) is object


def test_load_fa3_local_dir_without_the_variant_names_the_torch_needed(monkeypatch, tmp_path):
    _fake_fa3_dir(tmp_path, variant="torch210-cxx11-cu128-x86_64-linux-not-this-one")
    monkeypatch.setattr(ab, "_fa3_interface", None)
    monkeypatch.setenv("SPEEDRUN_FA3_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="holds no package for build variant") as err:
        ab.fa3_package_dir(tmp_path, variant="torch213-cxx11-cpu-x86_64-linux")
    assert "2.10.0+cu128" in str(err.value) and "torch210-cxx11-cu128-x86_64-linux-not-this-one" in str(err.value)


class _HubHTTPError(Exception):
    """What huggingface_hub raises for an HTTP error: the response carries the status."""

    def __init__(self, message, status):
        super().__init__(message)
        self.response = types.SimpleNamespace(status_code=status)


def test_load_fa3_on_a_401_names_both_fixes(monkeypatch, tmp_path):
    monkeypatch.delenv("SPEEDRUN_FA3_DIR", raising=False)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    _fake_kernels_package(monkeypatch, tmp_path, b"x", fails=_HubHTTPError("Unauthorized for url", 401))
    with pytest.raises(RuntimeError, match="refused") as err:
        ab.load_fa3()
    text = str(err.value)
    assert "hf auth login" in text and "SPEEDRUN_FA3_DIR" in text and "HF_HUB_OFFLINE=1" in text
    assert f"hf download {ab.FA3_REPO} --revision {ab.FA3_REVISION}" in text


def test_load_fa3_without_a_build_variant_names_the_torch_needed(monkeypatch, tmp_path):
    monkeypatch.delenv("SPEEDRUN_FA3_DIR", raising=False)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    fails = FileNotFoundError(f"Cannot find a build variant for this system in {ab.FA3_REPO}")
    _fake_kernels_package(monkeypatch, tmp_path, b"x", fails=fails)
    with pytest.raises(RuntimeError, match="variant for torch 2.10.0\\+cu128 only") as err:
        ab.load_fa3()
    assert torch.__version__ in str(err.value) and "requirements-h100.txt" in str(err.value)
