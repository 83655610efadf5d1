"""The decode worker's allow-list of prefill workers (``--prefill-hosts``): which bootstrap_host values match,
that listed names are resolved off the event loop with a bounded rate, and that request-supplied names never are."""
from __future__ import annotations

import asyncio
import time

import pytest

from decode_worker.core.prefill_hosts import HostEntry, PrefillHosts, parse_prefill_hosts


def test_parse_entries():
    assert parse_prefill_hosts("Prefill.NS.svc.:30001, 10.0.0.7 ,[::1]:9,::1") == (
        HostEntry("prefill.ns.svc", 30001), HostEntry("10.0.0.7"), HostEntry("::1", 9), HostEntry("::1"))
    assert parse_prefill_hosts("*") is None
    assert parse_prefill_hosts("") == ()


def test_unset_allows_loopback_only():
    hosts = PrefillHosts(())
    assert all(hosts.allowed_now(h, 1) for h in ("127.0.0.1", "127.9.9.9", "localhost", "::1", "[::1]"))
    assert not any(hosts.allowed_now(h, 1) for h in ("10.0.0.1", "evil.example", "0.0.0.0", "localhost.evil"))


def test_star_allows_any():
    assert PrefillHosts(None).allowed_now("evil.example", 1)


def test_literal_names_addresses_and_ports():
    hosts = PrefillHosts(parse_prefill_hosts("prefill:30001,10.0.0.7"))
    assert hosts.allowed_now("PREFILL", 30001) and not hosts.allowed_now("prefill", 30002)
    assert hosts.allowed_now("10.0.0.7", 1) and hosts.allowed_now("10.0.0.7", 2)  # no port: any port
    assert not hosts.allowed_now("10.0.0.8", 30001)


class Dns:
    """A stand-in resolver: what each listed name resolves to now, and how many lookups were made."""

    def __init__(self, table: dict[str, set[str]], delay_s: float = 0.0):
        self.table, self.delay_s, self.calls = table, delay_s, []

    async def __call__(self, name: str) -> frozenset[str]:
        self.calls.append(name)
        await asyncio.sleep(self.delay_s)
        if name not in self.table:
            raise OSError("no such name")
        return frozenset(self.table[name])


def test_an_address_matches_a_listed_name_it_resolves_to_and_a_new_pod_is_looked_up():
    dns = Dns({"prefill": {"10.1.0.5"}})
    hosts = PrefillHosts(parse_prefill_hosts("prefill:30001"), min_refresh_s=0.0, resolver=dns)

    async def scenario():
        assert await hosts.allowed("10.1.0.5", 30001)
        assert not await hosts.allowed("10.1.0.5", 30002)  # the entry's port
        dns.table["prefill"].add("10.1.0.6")  # a pod joined the headless service
        assert await hosts.allowed("10.1.0.6", 30001)
        assert not await hosts.allowed("10.9.9.9", 30001)

    asyncio.run(scenario())
    assert set(dns.calls) == {"prefill"}


def test_request_names_are_never_resolved():
    dns = Dns({"prefill": {"10.1.0.5"}, "evil.example": {"10.1.0.5"}})
    hosts = PrefillHosts(parse_prefill_hosts("prefill"), resolver=dns)
    assert not asyncio.run(hosts.allowed("evil.example", 1))  # resolves to an allowed address, but is not listed
    assert dns.calls == []


def test_lookups_are_shared_and_rate_bounded():
    """A flood of unknown addresses costs one lookup per min_refresh_s, however many requests wait on it."""
    dns = Dns({"prefill": {"10.1.0.5"}}, delay_s=0.05)
    hosts = PrefillHosts(parse_prefill_hosts("prefill"), min_refresh_s=60.0, resolver=dns)

    async def flood():
        return await asyncio.gather(*(hosts.allowed(f"10.2.0.{i}", 1) for i in range(50)))

    assert not any(asyncio.run(flood()))
    assert dns.calls == ["prefill"]


def test_failed_lookup_keeps_the_last_addresses_and_a_slow_one_has_a_deadline(caplog):
    dns = Dns({"prefill": {"10.1.0.5"}})
    hosts = PrefillHosts(parse_prefill_hosts("prefill"), ttl_s=0.0, min_refresh_s=0.0, resolve_timeout_s=0.1,
                         resolver=dns)

    async def scenario():
        assert await hosts.allowed("10.1.0.5", 1)
        del dns.table["prefill"]  # DNS down: the last known addresses stay
        assert await hosts.allowed("10.1.0.5", 1)
        dns.table["prefill"], dns.delay_s = {"10.1.0.6"}, 5.0
        started = time.monotonic()
        assert not await hosts.allowed("10.1.0.6", 1)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.0
    assert "resolving prefill host prefill failed" in caplog.text


@pytest.mark.parametrize("raw", ["p0:0", "p0:99999", "[::1]x", "a b"])
def test_bad_entries(raw):
    with pytest.raises(ValueError):
        parse_prefill_hosts(raw)
