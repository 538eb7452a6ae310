"""Where a rollout's "egress": "public" may go (capture/egress.py): public addresses only, by
number (the address checked being the one dialled), whatever the spelling: an IPv6 address
that carries an IPv4 one is as closed as that IPv4 address. Nothing here is dialled."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from capture.egress import EgressRefused, embedded_ipv4, is_open, public_address


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.8.9.10", "10.1.2.3", "172.20.0.1", "192.168.1.1", "169.254.169.254",
     "100.64.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1",
     "fd00::1", "fec0::1", "ff02::1"],
)  # fmt: skip
def test_loopback_private_and_link_local_are_closed(address: str) -> None:
    assert not is_open(address)


@pytest.mark.parametrize("address", ["151.101.0.223", "8.8.8.8", "2606:4700::1111"])
def test_public_addresses_are_open(address: str) -> None:
    assert is_open(address)


# Each IPv6 form that carries an IPv4 address: (form, closed examples, open examples).
EMBEDDINGS = [
    ("IPv4-mapped ::ffff:0:0/96", ["::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:a9fe:a9fe"],
     ["::ffff:8.8.8.8"]),
    ("IPv4-compatible ::/96", ["::127.0.0.1", "::a00:1", "::192.168.0.1"], ["::8.8.8.8"]),
    ("SIIT ::ffff:0:0:0/96", ["::ffff:0:a00:1", "::ffff:0:127.0.0.1"], ["::ffff:0:8.8.8.8"]),
    ("NAT64 64:ff9b::/96", ["64:ff9b::a00:1", "64:ff9b::127.0.0.1", "64:ff9b::169.254.169.254"],
     ["64:ff9b::8.8.8.8"]),
    # RFC 8215's local-use prefix, read at each RFC 6052 placement: /96 (the last 32 bits),
    # /48 (bits 48-63 and 72-87), /64 (bits 72-103). Open only if every reading is public.
    ("NAT64 local-use 64:ff9b:1::/48",
     ["64:ff9b:1::a00:1", "64:ff9b:1:7f00:0:100::", "64:ff9b:1:0:a:0:100::"],
     ["64:ff9b:1:808:8:808:808:808"]),
    ("6to4 2002::/16", ["2002:7f00:1::1", "2002:a9fe:a9fe::1", "2002:c0a8:101::"],
     ["2002:808:808::1"]),
    # Teredo: the server (bits 32-63) and the client (the last 32 bits, inverted).
    ("Teredo 2001::/32 server", ["2001:0:7f00:1:8000:63bf:f7f7:f7f7"],
     ["2001:0:4136:e378:8000:63bf:3fff:fdd2"]),
    ("Teredo 2001::/32 client", ["2001:0:4136:e378:8000:63bf:f5ff:fffe",
                                 "2001:0:4136:e378:8000:63bf:80ff:fffe"], []),
    # ISATAP interface ids under any prefix, with or without the u/l and group bits.
    ("ISATAP ...:0:5efe:a.b.c.d", ["2606:4700::5efe:7f00:1", "2606:4700::200:5efe:a00:1",
                                   "2606:4700::300:5efe:c0a8:101", "fe80::5efe:a9fe:a9fe"],
     ["2606:4700::200:5efe:808:808"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("form", "address"), [(form, a) for form, closed, _ in EMBEDDINGS for a in closed]
)
def test_an_ipv6_form_of_a_closed_ipv4_address_is_closed(form: str, address: str) -> None:
    assert not is_open(address), form


@pytest.mark.parametrize(
    ("form", "address"), [(form, a) for form, _, opened in EMBEDDINGS for a in opened]
)
def test_an_ipv6_form_of_a_public_ipv4_address_is_open(form: str, address: str) -> None:
    assert is_open(address), form


def test_the_ipv4_addresses_each_form_carries() -> None:
    def carried(address: str) -> list[str]:
        return [str(v4) for v4 in embedded_ipv4(ipaddress.IPv6Address(address))]

    assert carried("::ffff:0:10.0.0.1") == ["10.0.0.1"]
    assert carried("2002:7f00:1::1") == ["127.0.0.1"]
    assert carried("2001:0:7f00:1:8000:63bf:f7f7:f7f7") == ["127.0.0.1", "8.8.8.8"]
    assert "127.0.0.1" in carried("64:ff9b:1:7f00:0:100::")  # the /48 placement
    assert carried("2606:4700::200:5efe:808:808") == ["8.8.8.8"]
    assert carried("2606:4700::1111") == []


@pytest.mark.parametrize("address", ["fe80::1%eth0", "2606:4700::1111%lo", "::ffff:8.8.8.8%1"])
def test_an_address_with_a_zone_id_is_closed(address: str) -> None:
    assert not is_open(address)


def run(host: str, port: int = 443) -> str:
    return asyncio.run(public_address(host, port))


def test_a_literal_is_dialled_in_its_canonical_form() -> None:
    assert run("8.8.8.8") == "8.8.8.8"
    assert run("2606:4700:0000:0000::1111") == "2606:4700::1111"
    assert run("::ffff:8.8.8.8") == "::ffff:808:808"
    assert run("64:ff9b::8.8.8.8") == "64:ff9b::808:808"


@pytest.mark.parametrize(
    ("host", "carried"),
    [("::127.0.0.1", "127.0.0.1"), ("::ffff:127.0.0.1", "127.0.0.1"),
     ("64:ff9b::10.0.0.1", "10.0.0.1"), ("2002:a9fe:a9fe::1", "169.254.169.254"),
     ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "10.0.0.1")],
)  # fmt: skip
def test_a_literal_carrying_a_closed_address_is_refused_naming_it(host: str, carried: str) -> None:
    with pytest.raises(EgressRefused, match=f"which carries {carried}"):
        run(host)


@pytest.mark.parametrize("host", ["fe80::1%eth0", "2606:4700::1111%lo", "fe80::1%\nforged"])
def test_a_zone_id_is_refused(host: str) -> None:
    with pytest.raises(EgressRefused, match="zone id") as refused:
        run(host)
    assert "\n" not in str(refused.value)


# What ipaddress refuses but the system's resolver reads as a number (inet_aton: decimal,
# octal, hex, short forms; IDNA folds full-width digits): checked and dialled as that number,
# never as the spelling. No DNS is asked for these.
@pytest.mark.parametrize(
    "host", ["2130706433", "0177.0.0.1", "0x7f.1", "0x7f000001", "127.1", "０x7f.0.0.1",
             "１２７.０.０.１", "012.0.0.1", "0xa9.0xfe.0xa9.0xfe"],
)  # fmt: skip
def test_a_closed_address_spelled_otherwise_is_refused_by_its_number(host: str) -> None:
    with pytest.raises(EgressRefused, match=r"resolves to (127\.0\.0\.1|10\.0\.0\.1|169\.254)"):
        run(host)


@pytest.mark.parametrize("host", ["134744072", "010.010.010.010", "0x8.0x8.0x8.0x8", "8.526344"])
def test_a_public_address_spelled_otherwise_is_dialled_as_its_number(host: str) -> None:
    assert run(host) == "8.8.8.8"


def test_a_name_is_dialled_at_the_address_that_was_checked() -> None:
    with pytest.raises(EgressRefused, match="localhost resolves to .*loopback, private"):
        run("localhost")
    with pytest.raises(EgressRefused, match="169.254.169.254"):
        run("169.254.169.254", 80)
    with pytest.raises(EgressRefused, match="does not resolve"):
        run("no-such-host.invalid")
