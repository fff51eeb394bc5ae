"""A peer's identity: the persistent RSA key that signs its DHT records, kept beside its libp2p identity file."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

from hivemind.utils.crypto import RSAPrivateKey

from peer.swarm.errors import NetworkSetupError
from peer.swarm.hivemind_seam import private_key_from_der

logger = logging.getLogger(__name__)


def signing_key_path(identity_path: Optional[str]) -> Optional[str]:
    """The signing key lives beside the libp2p identity file, so one flag keeps both stable."""
    return None if identity_path is None else identity_path + ".rsa"


def load_or_create_signing_key(path: Optional[str]) -> RSAPrivateKey:
    """The RSA key that signs this peer's DHT records; persistent when a path is given.

    Written atomically (temp file + rename) with mode 0600 so a crash never leaves half a key.
    """
    if path is None:
        return RSAPrivateKey()
    key_path = Path(path)
    if key_path.exists():
        try:
            return private_key_from_der(key_path.read_bytes())
        except Exception as e:
            raise NetworkSetupError(
                f"signing key {key_path} is unreadable or corrupt ({e}); move it away "
                "to generate a new one (the peer will get a new metrics identity)"
            ) from None
    key = RSAPrivateKey()
    key_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=key_path.parent, prefix=key_path.name + ".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_bytes())
    os.chmod(tmp, 0o600)
    os.replace(tmp, key_path)
    logger.info("Generated a new signing key in %s", key_path)
    return key
