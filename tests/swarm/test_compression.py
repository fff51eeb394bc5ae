"""Every hivemind compression the project uses must round-trip (numpy 2.4 breaks hivemind 1.1.12's 8-bit codecs)."""

import numpy as np
import pytest
import torch
from hivemind.compression import (
    BlockwiseQuantization,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from packaging.version import Version

pytestmark = pytest.mark.deps  # scripts/test.sh --newest/--oldest run these


def test_numpy_version_is_compatible_with_hivemind():
    assert Version(np.__version__) < Version("2.4"), "hivemind 1.1.12 8-bit codecs need numpy<2.4"


# (codec, bound on mean |error| relative to mean |x|)
CODECS = [
    (NoCompression(), 0.0),
    (Float16Compression(), 1e-3),
    (BlockwiseQuantization(), 0.02),
    (Uniform8BitQuantization(), 0.05),
    (Quantile8BitQuantization(), 0.05),
]


@pytest.mark.parametrize("codec,bound", CODECS, ids=lambda c: type(c).__name__ if not isinstance(c, float) else "")
@pytest.mark.parametrize("shape", [(4096,), (257, 129)])
def test_round_trip(codec, bound, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    y = deserialize_torch_tensor(serialize_torch_tensor(x, codec.compression_type))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    rel = ((x - y).abs().mean() / x.abs().mean()).item()
    assert rel <= bound, f"{type(codec).__name__}: mean relative error {rel:.4f} > {bound}"
    # all of the data comes back, not just a prefix
    assert (y != 0).float().mean() > 0.9
