"""A worker pool's sandbox policy (D33): parsing its settings and deciding destinations."""
import pytest

from noetl_mesh.sandbox.policy import Policy, PolicyError, from_env, parse_destinations


def test_defaults_close_loopback_link_local_and_metadata():
    p = from_env({})
    assert p.enabled and not p.python_network and p.allow == () and p.data_dirs == ()
    assert "loopback" in p.refusal("127.0.0.1", 80)
    assert "loopback" in p.refusal("127.3.4.5", 4222)
    assert "loopback" in p.refusal("::1", 80)
    assert "loopback" in p.refusal("::ffff:127.0.0.1", 80)  # v4-mapped is the v4 address
    # so is every other IPv6 spelling of one: v4-compatible, v4-translated, NAT64, 6to4
    teredo = "2001:0:4136:e378:8000:63bf:80ff:fffe"  # client 127.0.0.1 (stored inverted)
    for spelled in ("::127.0.0.1", "::ffff:0:7f00:1", "64:ff9b::7f00:1", "64:ff9b:1::7f00:1", "2002:7f00:1::1", teredo):
        assert "loopback" in p.refusal(spelled, 80), spelled
    assert "metadata" in p.refusal("::169.254.169.254", 80) and "metadata" in p.refusal("64:ff9b::a9fe:a9fe", 80)
    assert "unspecified" in p.refusal("::", 80) and "loopback" in p.refusal("::1", 80)
    assert p.refusal("64:ff9b::5db8:d822", 443) is None  # 93.184.216.34 through NAT64: a public address
    assert "metadata" in p.refusal("169.254.169.254", 80)
    assert "metadata" in p.refusal("fd00:ec2::254", 80)
    assert "link-local" in p.refusal("169.254.1.1", 80)
    assert "link-local" in p.refusal("fe80::1", 80)
    assert "unspecified" in p.refusal("0.0.0.0", 80)
    assert p.refusal("93.184.216.34", 443) is None
    assert p.refusal("10.1.2.3", 5432) is None  # private networks are the user's own


def test_allow_list_opens_exactly_what_it_names():
    p = from_env({"NOETL_SANDBOX_ALLOW_NET": "127.0.0.1:8765, [::1]:8080, 169.254.0.0/16, api.internal:443"})
    assert p.refusal("127.0.0.1", 8765) is None
    assert p.refusal("127.0.0.1", 8766) is not None
    assert p.refusal("::1", 8080) is None and p.refusal("::1", 8081) is not None
    assert p.refusal("169.254.7.7", 1) is None
    assert p.refusal("127.0.0.1", 443, host="api.internal") is None
    assert p.refusal("127.0.0.1", 443, host="API.internal.") is None
    assert p.refusal("127.0.0.1", 443, host="other") is not None


def test_engine_endpoints_stay_closed_whatever_the_allow_list():
    p = from_env({"NOETL_SANDBOX_ALLOW_NET": "127.0.0.0/8"}).with_engine_endpoints([("127.0.0.1", 4222)])
    assert "NATS" in p.refusal("127.0.0.1", 4222)
    assert p.refusal("127.0.0.1", 4223) is None


@pytest.mark.parametrize("text, where", [
    ("127.0.0.1:0", "port"), ("127.0.0.1:x", "port"), ("[::1", "]"), ("[::1]x", "port"),
    ("bad host!", "neither"), ("a/b/c", "neither"), ("host:99999", "port"),
])
def test_bad_allow_entries_are_named(text, where):
    with pytest.raises(PolicyError) as e:
        parse_destinations(text)
    assert "NOETL_SANDBOX_ALLOW_NET" in str(e.value) and where in str(e.value)


def test_switches_and_data_dirs():
    assert not from_env({"NOETL_SANDBOX": "off"}).enabled
    assert from_env({"NOETL_SANDBOX_PYTHON_NET": "1"}).python_network
    assert from_env({"NOETL_SANDBOX_DATA_DIRS": "/data:/w/x/"}).data_dirs == ("/data", "/w/x")
    with pytest.raises(PolicyError, match="NOETL_SANDBOX_DATA_DIRS"):
        from_env({"NOETL_SANDBOX_DATA_DIRS": "relative/dir"})
    with pytest.raises(PolicyError, match="NOETL_SANDBOX="):
        from_env({"NOETL_SANDBOX": "maybe"})
    with pytest.raises(PolicyError, match="NOETL_SANDBOX_PYTHON_NET"):
        from_env({"NOETL_SANDBOX_PYTHON_NET": "sometimes"})
    assert isinstance(Policy().describe(), str)


def test_a_pools_roles_default_to_anyone_and_to_admins_on_a_trusted_pool():
    """D33: NOETL_POOL_ROLES, whose executions a pool runs (their starter's roles)."""
    assert from_env({}).roles is None
    trusted = from_env({"NOETL_SANDBOX": "off"})
    assert trusted.roles == {"admin"}
    assert from_env({"NOETL_SANDBOX": "off", "NOETL_POOL_ROLES": "*"}).roles is None  # said in so many words
    named = from_env({"NOETL_POOL_ROLES": " admin, operator "})
    assert named.roles == {"admin", "operator"}
    assert "runs executions started by admin, operator" in named.describe()
    for bad in ("vault-users", "admin,*", ",", "admin,nobody"):
        with pytest.raises(PolicyError, match="NOETL_POOL_ROLES="):
            from_env({"NOETL_POOL_ROLES": bad})


def test_the_worker_hosts_own_addresses_are_closed_unless_the_allow_list_opens_them(tmp_path):
    from dataclasses import replace

    from noetl_mesh.sandbox.net import host_addresses
    from noetl_mesh.sandbox.policy import Policy, parse_destinations

    trie = tmp_path / "fib_trie"
    trie.write_text("Main:\n  +-- 0.0.0.0/0 3 0 4\n     |-- 127.0.0.1\n        /32 host LOCAL\n"
                    "     |-- 10.1.2.3\n        /32 host LOCAL\n     |-- 10.1.2.255\n        /32 link BROADCAST\n"
                    "     |-- 10.1.2.0\n        /24 link UNICAST\n")
    inet6 = tmp_path / "if_inet6"
    inet6.write_text("00000000000000000000000000000001 01 80 10 80       lo\n"
                     "fd000000000000000000000000000002 04 40 00 82     eth0\n")
    found = host_addresses(str(trie), str(inet6))
    assert found == ["127.0.0.1", "10.1.2.3", "::1", "fd00::2"]
    assert host_addresses(str(tmp_path / "none"), str(tmp_path / "none")) == []
    policy = Policy().with_host_addresses(found)
    assert policy.refusal("10.1.2.3", 80) == "10.1.2.3 is an address of the worker's own host"
    assert policy.refusal("::ffff:10.1.2.3", 80) == "10.1.2.3 is an address of the worker's own host"
    assert policy.refusal("fd00::2", 443) == "fd00::2 is an address of the worker's own host"
    assert policy.refusal("10.1.2.4", 80) is None  # a neighbour on the same network: a private address, open
    opened = replace(policy, allow=parse_destinations("10.1.2.3:8080"))
    assert opened.refusal("10.1.2.3", 8080) is None and opened.refusal("10.1.2.3", 80) is not None
