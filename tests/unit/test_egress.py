"""Where a rollout's "egress": "public" may go (capture/egress.py): public addresses only, the
address checked being the one dialled."""

from __future__ import annotations

import asyncio

import pytest

from capture.egress import EgressRefused, is_open, public_address


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.8.9.10", "10.1.2.3", "172.20.0.1", "192.168.1.1", "169.254.169.254",
     "100.64.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1",
     "fd00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "2002:7f00:1::1"],
)  # fmt: skip
def test_loopback_private_and_link_local_are_closed(address: str) -> None:
    assert not is_open(address)


@pytest.mark.parametrize("address", ["151.101.0.223", "8.8.8.8", "2606:4700::1111"])
def test_public_addresses_are_open(address: str) -> None:
    assert is_open(address)


def test_a_name_is_dialled_at_the_address_that_was_checked() -> None:
    assert asyncio.run(public_address("8.8.8.8", 443)) == "8.8.8.8"
    with pytest.raises(EgressRefused, match="localhost resolves to .*loopback, private"):
        asyncio.run(public_address("localhost", 443))
    with pytest.raises(EgressRefused, match="169.254.169.254"):
        asyncio.run(public_address("169.254.169.254", 80))
    with pytest.raises(EgressRefused, match="does not resolve"):
        asyncio.run(public_address("no-such-host.invalid", 443))
