"""``[kv] format`` offers what the batched pool stores; a compression method says why not.

Two of the library's KV compression methods (turboquant_mse, polar) are pool formats too;
the others run per request only (``PooledKVCache``): naming one as the server's format is
refused at start-up with the method's reason, not offered and not answered with a bare
list of choices.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.settings import ConfigError
from tests.support.servers import make_settings
from veloxquant_mlx.cache import KVCacheFactory
from veloxquant_mlx.exceptions import KVFormatError
from veloxquant_mlx.memory.kv_format import KV_FORMATS, KVFormat
from veloxquant_mlx.memory.pool_config import (
    PER_REQUEST_METHODS,
    POOL_CODED_METHODS,
    POOL_KV_FORMATS,
)

REPO = Path(__file__).resolve().parents[2]


def test_every_method_of_the_family_is_placed():
    """A method registered in veloxquant_mlx.cache is a pool format or has its reason."""
    methods = set(KVCacheFactory.available_methods())
    assert methods == set(PER_REQUEST_METHODS) | set(POOL_CODED_METHODS)
    assert tuple(KV_FORMATS) == POOL_KV_FORMATS
    assert set(POOL_CODED_METHODS) <= set(POOL_KV_FORMATS)
    assert not set(PER_REQUEST_METHODS) & set(POOL_KV_FORMATS)


@pytest.mark.parametrize("method", sorted(PER_REQUEST_METHODS))
def test_a_method_as_the_servers_format_is_refused_with_its_reason(method):
    with pytest.raises(ConfigError) as caught:
        make_settings(kv={"format": method})
    message = str(caught.value)
    assert "kv.format" in message and "runs per request" in message
    assert PER_REQUEST_METHODS[method] in message
    assert "native, q8, q4, turboquant_mse, polar" in message
    with pytest.raises(KVFormatError, match="runs per request"):
        KVFormat(method)


def test_pool_formats_are_accepted_and_unknown_names_listed():
    for name in POOL_KV_FORMATS:
        assert make_settings(kv={"format": name}).kv.format == name
    with pytest.raises(ConfigError, match="unknown KV format 'fp4'; choose one of native"):
        make_settings(kv={"format": "fp4"})


@pytest.mark.slow
def test_the_server_stops_at_start_up_on_a_method_flag():
    done = subprocess.run([sys.executable, "-m", "server", "--model", "tiny",
                           "--kv-cache-dtype", "kivi", "--print-config"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'kivi' is a KV compression method that runs per request" in done.stderr
