import pytest

from transport import Addr, AddressError, DialError, dial, parse_addr


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:7000", Addr("tcp", "127.0.0.1", 7000, "")),
        ("node-3.lan:1", Addr("tcp", "node-3.lan", 1, "")),
        ("tcp://10.0.0.2:65535", Addr("tcp", "10.0.0.2", 65535, "")),
        ("[::1]:7000", Addr("tcp", "::1", 7000, "")),
        ("ws://host:8080", Addr("ws", "host", 8080, "/")),
        ("ws://host:8080/", Addr("ws", "host", 8080, "/")),
        ("ws://host:8080/mesh/peer?x=1", Addr("ws", "host", 8080, "/mesh/peer?x=1")),
        ("ws://host?x=1", Addr("ws", "host", 80, "/?x=1")),
        ("WS://[fe80::1]:9/p", Addr("ws", "fe80::1", 9, "/p")),
        ("ws://host", Addr("ws", "host", 80, "/")),
    ],
)
def test_parse_good(text, want):
    got = parse_addr(text)
    assert got == want
    assert parse_addr(str(got)) == got


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("host", "missing port"),
        ("host:", "not a number"),
        ("host:http", "not a number"),
        ("host:70000", "out of range"),
        (":7000", "missing host"),
        ("::1:7000", "needs brackets"),
        ("[::1:7000", "unclosed"),
        ("[::1]x:7000", "unexpected"),
        ("[host]:1", "not an IPv6 literal"),
        ("wss://host:1", "not supported"),
        ("http://host:1", "unknown scheme"),
        ("host:1/path", "takes no path"),
        ("ws://host:1/p#frag", "fragment"),
        (" host:1", "whitespace"),
        ("ws://:80/", "missing host"),
    ],
)
def test_parse_bad_names_string_and_reason(text, reason):
    with pytest.raises(AddressError) as info:
        parse_addr(text)
    assert repr(text) in str(info.value)
    assert reason in str(info.value)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, DialError)  # `except DialError` around dial covers it


def test_parse_rejects_non_str():
    with pytest.raises(AddressError, match="expected a str"):
        parse_addr(7000)  # type: ignore[arg-type]


async def test_dial_rejects_a_malformed_address_before_connecting():
    with pytest.raises(AddressError, match="missing port"):
        await dial("just-a-host")
