"""tools/debian-deb.sh, which fetches the trixie packages `make test` installs as root (tools/docker-engine.sh):
a .deb comes out only when a key of the keyring signed the suite's InRelease, Packages.xz matches that signed
text and the .deb matches its entry in Packages.xz. Against a mirror made here (file://), signed with a
throwaway key, and the same mirror tampered with every way the script must refuse."""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "debian-deb.sh"
TOOLS = ("gpg", "gpgv", "gpgconf", "curl", "xz", "sha256sum")
pytestmark = pytest.mark.skipif(any(shutil.which(tool) is None for tool in TOOLS), reason=f"needs {', '.join(TOOLS)}")
WANTED = "dpserve-probe"
DEB = b"!<arch>\nthe package's bytes\n"
TAMPERED = b"!<arch>\nsomething else entirely\n"


@dataclass
class Signer:
    """Two throwaway keys in a GNUPGHOME of their own: the archive's (exported as the keyring) and an intruder's."""

    home: Path
    archive: str
    intruder: str
    keyring: Path

    def gpg(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        env = {**os.environ, "GNUPGHOME": str(self.home)}
        return subprocess.run(["gpg", "--batch", "--quiet", *args], env=env, check=True, capture_output=True)

    def clearsign(self, text: str, key: str, out: Path) -> None:
        source = out.with_name("Release")
        source.write_text(text)
        out.unlink(missing_ok=True)
        self.gpg("--local-user", key, "--clearsign", "--output", str(out), str(source))


@pytest.fixture(scope="module")
def signer() -> Iterator[Signer]:
    # A short path: gpg-agent's socket lives in GNUPGHOME, and socket paths are short.
    home = Path(tempfile.mkdtemp(prefix="gpg"))
    home.chmod(0o700)
    keys = Signer(home, "archive@dpserve.test", "intruder@dpserve.test", home / "keyring.gpg")
    try:
        for uid in (keys.archive, keys.intruder):
            keys.gpg("--passphrase", "", "--pinentry-mode", "loopback", "--quick-gen-key", uid, "ed25519", "sign", "0")
        keys.keyring.write_bytes(keys.gpg("--export", keys.archive).stdout)
        yield keys
    finally:
        subprocess.run(["gpgconf", "--kill", "all"], env={**os.environ, "GNUPGHOME": str(home)}, check=False)
        shutil.rmtree(home, ignore_errors=True)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def packages_text(deb: bytes) -> str:
    # Another package first, so the wanted one's SHA256 must come from its own stanza.
    return (
        "Package: dpserve-other\nVersion: 1\nFilename: pool/main/d/dpserve-other/dpserve-other_1_amd64.deb\n"
        f"SHA256: {sha256(b'other')}\n\n"
        f"Package: {WANTED}\nVersion: 1.0-1\nArchitecture: amd64\n"
        f"Filename: pool/main/d/{WANTED}/{WANTED}_1.0-1_amd64.deb\nSize: {len(deb)}\nSHA256: {sha256(deb)}\n\n"
    )


def release_text(index: bytes, codename: str = "trixie", extra: str = "") -> str:
    return (
        f"Origin: Debian\nSuite: stable\nCodename: {codename}\n{extra}"
        f"MD5Sum:\n {hashlib.md5(index).hexdigest()} {len(index)} main/binary-amd64/Packages.xz\n"
        f"SHA256:\n {sha256(b'x')} 1 contrib/binary-amd64/Packages.xz\n"
        f" {sha256(index)} {len(index)} main/binary-amd64/Packages.xz\n"
    )


@dataclass
class Mirror:
    root: Path
    signer: Signer

    @property
    def index(self) -> Path:
        return self.root / "dists" / "trixie" / "main" / "binary-amd64" / "Packages.xz"

    @property
    def inrelease(self) -> Path:
        return self.root / "dists" / "trixie" / "InRelease"

    @property
    def deb(self) -> Path:
        return self.root / "pool" / "main" / "d" / WANTED / f"{WANTED}_1.0-1_amd64.deb"

    def publish(self, deb: bytes, *, key: str | None = None, codename: str = "trixie", extra: str = "") -> None:
        """The package, its index and the InRelease naming that index, signed by `key` (the archive's)."""
        for path in (self.index, self.deb):
            path.parent.mkdir(parents=True, exist_ok=True)
        self.deb.write_bytes(deb)
        self.index.write_bytes(lzma.compress(packages_text(deb).encode(), format=lzma.FORMAT_XZ))
        text = release_text(self.index.read_bytes(), codename, extra)
        self.signer.clearsign(text, key or self.signer.archive, self.inrelease)


@pytest.fixture
def mirror(tmp_path: Path, signer: Signer) -> Mirror:
    built = Mirror(tmp_path / "mirror", signer)
    built.publish(DEB)
    return built


def fetch(mirror: Mirror, out: Path, package: str = WANTED) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DEBIAN_MIRROR": mirror.root.as_uri(),
        "DEBIAN_SUITE": "trixie",
        "DEBIAN_KEYRING": str(mirror.signer.keyring),
        "DEBIAN_ARCH": "amd64",
    }
    return subprocess.run([str(SCRIPT), package, str(out)], env=env, capture_output=True, text=True, timeout=60)


def test_a_package_the_signed_index_vouches_for_is_fetched(mirror: Mirror, tmp_path: Path) -> None:
    result = fetch(mirror, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    fetched = Path(result.stdout.strip())
    assert fetched == tmp_path / "out" / mirror.deb.name
    assert fetched.read_bytes() == DEB


def _deb_swapped(mirror: Mirror) -> None:
    mirror.deb.write_bytes(TAMPERED)


def _index_swapped(mirror: Mirror) -> None:
    # An index that vouches for the swapped .deb, under the InRelease that was signed for the old index.
    mirror.deb.write_bytes(TAMPERED)
    mirror.index.write_bytes(lzma.compress(packages_text(TAMPERED).encode(), format=lzma.FORMAT_XZ))


def _signed_by_intruder(mirror: Mirror) -> None:
    mirror.publish(TAMPERED, key=mirror.signer.intruder)


def _release_edited_after_signing(mirror: Mirror) -> None:
    inrelease, old_sum = mirror.inrelease.read_text(), sha256(mirror.index.read_bytes())
    mirror.publish(TAMPERED, key=mirror.signer.intruder)
    # The archive's signature kept, the text it signed given the new index's SHA256.
    mirror.inrelease.write_text(inrelease.replace(old_sum, sha256(mirror.index.read_bytes())))


def _unsigned(mirror: Mirror) -> None:
    mirror.publish(TAMPERED)
    mirror.inrelease.write_text(release_text(mirror.index.read_bytes()))


def _another_suite(mirror: Mirror) -> None:
    mirror.publish(TAMPERED, codename="sid")


def _expired(mirror: Mirror) -> None:
    mirror.publish(TAMPERED, extra="Valid-Until: Sat, 01 Jan 2000 00:00:00 UTC\n")


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        (_deb_swapped, f"pool/main/d/{WANTED}/{WANTED}_1.0-1_amd64.deb has SHA256"),
        (_index_swapped, "dists/trixie/main/binary-amd64/Packages.xz has SHA256"),
        (_signed_by_intruder, "InRelease is not signed by a key of"),
        (_release_edited_after_signing, "InRelease is not signed by a key of"),
        (_unsigned, "InRelease is not signed by a key of"),
        (_another_suite, "not trixie's"),
        (_expired, "expired"),
    ],
)
def test_anything_the_signature_does_not_vouch_for_is_refused(
    mirror: Mirror, tmp_path: Path, tamper: Callable[[Mirror], None], says: str
) -> None:
    tamper(mirror)
    result = fetch(mirror, tmp_path / "out")
    assert result.returncode != 0
    assert says in result.stderr, result.stderr
    assert result.stdout == ""
    assert not any((tmp_path / "out").glob("*.deb")), "a refused package was left where it would be installed"


def test_a_package_the_index_lacks_is_named(mirror: Mirror, tmp_path: Path) -> None:
    result = fetch(mirror, tmp_path / "out", package="dpserve-absent")
    assert result.returncode != 0
    assert "no dpserve-absent with a SHA256 in trixie's main/binary-amd64/Packages.xz" in result.stderr


def test_the_engine_script_installs_only_what_the_checker_printed() -> None:
    engine = (SCRIPT.parent / "docker-engine.sh").read_text()
    installs = [line.strip() for line in engine.splitlines() if "dpkg -i" in line]
    assert installs == ['$SUDO dpkg -i "$deb" >/dev/null'], installs
    assert '"$HERE/debian-deb.sh" "$1" "$dir")' in engine
