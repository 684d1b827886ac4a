"""Broker URLs and topic names: pure functions, no broker."""

from __future__ import annotations

import pytest

from swarm.bus.topics import (
    ANY,
    SCHEDULER_USER,
    BrokerUrlError,
    TopicError,
    TopicInfo,
    TopicKind,
    Topics,
    check_pattern,
    check_topic,
    parse_broker_url,
    topic_matches,
)
from swarm.errors import ConfigError


def test_parse_broker_url() -> None:
    addr = parse_broker_url("mqtt://alice:s%40cret@broker.example:1884")
    assert (addr.host, addr.port, addr.username, addr.password, addr.tls) == (
        "broker.example",
        1884,
        "alice",
        "s@cret",
        False,
    )
    assert "s@cret" not in repr(addr)
    assert parse_broker_url("mqtts://[::1]").port == 8883
    assert parse_broker_url("mqtt://h").port == 1883
    for bad in [
        "http://h:1",
        "mqtt://:1883",
        "mqtt://h:99999",
        "mqtt://h:0",
        "mqtt://h/x",
        "h:1883",
        "mqtt://u:tok@h:x",
    ]:
        with pytest.raises(BrokerUrlError) as info:
            parse_broker_url(bad)
        assert "tok" not in str(info.value)
    assert issubclass(BrokerUrlError, ConfigError)


def test_topics_build_and_parse() -> None:
    t = Topics("s/v1")
    assert t.prefix == "s/v1/"
    assert t.peer("p1") == "s/v1/peers/p1"
    assert t.assign("j", "p") == "s/v1/jobs/j/assign/p"
    assert t.load(ANY) == "s/v1/peers/+/load"
    assert t.parse(t.peer("p1")) == TopicInfo(TopicKind.PEER, None, "p1")
    assert t.parse(t.job("j")) == TopicInfo(TopicKind.JOB, "j", None)
    assert t.parse(t.assign("j", "p")) == TopicInfo(TopicKind.ASSIGN, "j", "p")
    assert t.parse(t.load("p")) == TopicInfo(TopicKind.LOAD, None, "p")
    assert t.parse(t.steps("j")) == TopicInfo(TopicKind.STEPS, "j", None)
    for bad_id in ["", "a/b", "#", "a+"]:
        with pytest.raises(TopicError):
            t.peer(bad_id)
    bad_topics = ["x/v1/peers/p", "s/v1/peers/p/q", "s/v1/jobs/j/other/p", "s/v1/peers/+"]
    for bad_topic in [*bad_topics, "s/v1/jobs/j/load/p", "s/v1/peers/p/load/q"]:
        with pytest.raises(TopicError):
            t.parse(bad_topic)
    assert topic_matches("s/v1/peers/p/load", t.load(ANY))
    assert not topic_matches("s/v1/peers/p/load", t.peer(ANY))
    assert topic_matches("s/v1/jobs/j", t.everything())
    assert not topic_matches("s/v1/jobs/j/steps", t.job(ANY))


def test_publish_topics_and_subscription_patterns_are_checked() -> None:
    check_topic("s/v1/peers/p")
    check_pattern("s/v1/+/p")
    check_pattern("s/v1/#")
    for bad in ["", "s/+/p", "s/#", "a\x00b"]:
        with pytest.raises(TopicError):
            check_topic(bad)
    for bad in ["", "s/a+/p", "s/#/p", "s/x#", "a\x00b"]:
        with pytest.raises(TopicError):
            check_pattern(bad)


def test_the_acl_lets_a_peer_publish_only_its_own_topics() -> None:
    t = Topics()
    assert t.may_publish("a", t.peer("a")) and t.may_publish("a", t.load("a"))
    for topic in (t.peer("b"), t.load("b"), t.assign("j", "a"), t.job("j"), t.steps("j")):
        assert not t.may_publish("a", topic)
    assert not t.may_publish("a", "elsewhere/peers/a") and not t.may_publish(None, t.peer("a"))
    assert all(
        t.may_publish(SCHEDULER_USER, x) for x in (t.job("j"), t.assign("j", "a"), "any/thing")
    )


@pytest.mark.attack("N3")
def test_a_peer_may_publish_a_fixed_two_topics_whatever_job_it_names() -> None:
    """Issue 44 N3: what bounds a peer's retained messages on Mosquitto (no per-user bound there,
    an ACL blind to the retain flag) is how many topics it may write: two, for any job."""
    t = Topics()
    shapes = ("jobs/x{}/load/a", "peers/a/{}", "peers/a/load/{}", "peers/a/x{}/load")
    made_up = [f"{t.prefix}{shape.format(i)}" for i in range(50) for shape in shapes]
    writable = {x for x in [t.peer("a"), t.load("a"), *made_up] if t.may_publish("a", x)}
    assert writable == {t.peer("a"), t.load("a")}
