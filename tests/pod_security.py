"""The Pod Security Standards' checks (kubernetes.io/docs/concepts/security/pod-security-standards), as the
Pod Security admission controller applies them to a pod spec: `violations(spec, "baseline")` lists what
keeps it from a level (empty: it may run in a namespace that enforces that level). Windows-only fields,
which pods here never set, are left out but hostProcess."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

LEVELS = ("privileged", "baseline", "restricted")

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
        "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)  # fmt: skip
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
VOLUME_SOURCE_FIELDS = frozenset({"name"})


def _containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(kind, [])


def _baseline(spec: dict[str, Any]) -> Iterator[str]:
    pod = spec.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield f"{field}: true (host namespaces)"
    if pod.get("windowsOptions", {}).get("hostProcess"):
        yield "hostProcess"
    for volume in spec.get("volumes", []):
        if "hostPath" in volume:
            yield f"volume {volume['name']}: hostPath"
    for sysctl in pod.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            yield f"sysctl {sysctl['name']}"
    yield from _baseline_context("pod", pod)
    for container in _containers(spec):
        name = container["name"]
        context = container.get("securityContext", {})
        if context.get("privileged"):
            yield f"{name}: privileged"
        if context.get("windowsOptions", {}).get("hostProcess"):
            yield f"{name}: hostProcess"
        added = set(context.get("capabilities", {}).get("add", []))
        if added - BASELINE_CAPABILITIES:
            yield f"{name}: capabilities added beyond baseline's: {sorted(added - BASELINE_CAPABILITIES)}"
        for port in container.get("ports", []):
            if port.get("hostPort"):
                yield f"{name}: hostPort {port['hostPort']}"
        if context.get("procMount", "Default") != "Default":
            yield f"{name}: procMount {context['procMount']}"
        yield from _baseline_context(name, context)


def _baseline_context(where: str, context: dict[str, Any]) -> Iterator[str]:
    if context.get("seccompProfile", {}).get("type") == "Unconfined":
        yield f"{where}: seccomp Unconfined"
    if context.get("appArmorProfile", {}).get("type") == "Unconfined":
        yield f"{where}: AppArmor Unconfined"
    selinux = context.get("seLinuxOptions", {})
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        yield f"{where}: SELinux options {selinux}"


def _restricted(spec: dict[str, Any]) -> Iterator[str]:
    pod = spec.get("securityContext", {})
    for volume in spec.get("volumes", []):
        kinds = set(volume) - VOLUME_SOURCE_FIELDS
        if not kinds <= RESTRICTED_VOLUMES:
            yield f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}"
    if pod.get("runAsUser") == 0:
        yield "pod: runAsUser 0"
    for container in _containers(spec):
        name = container["name"]
        context = container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            yield f"{name}: allowPrivilegeEscalation not false"
        if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            yield f"{name}: runAsNonRoot not true"
        if context.get("runAsUser") == 0:
            yield f"{name}: runAsUser 0"
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            yield f"{name}: seccomp profile {seccomp}, not RuntimeDefault or Localhost"
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            yield f"{name}: capabilities not dropping ALL"
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            yield f"{name}: capabilities added beyond NET_BIND_SERVICE"


def violations(spec: dict[str, Any], level: str) -> list[str]:
    """What keeps a pod spec from `level` (restricted includes baseline's checks)."""
    if level not in LEVELS:
        raise ValueError(f"no Pod Security level {level!r}: one of {', '.join(LEVELS)}")
    found: list[str] = []
    if level in ("baseline", "restricted"):
        found += _baseline(spec)
    if level == "restricted":
        found += _restricted(spec)
    return found
