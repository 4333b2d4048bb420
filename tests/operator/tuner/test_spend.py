"""Spend: replica-minutes run against those needed, and device-minutes where a replica runs on
several devices (tensor x pipeline parallel)."""

from __future__ import annotations

from llmfleet.operator.tuner.spend import Spend


def test_a_replica_over_several_devices_reports_device_minutes_beside_its_replica_minutes():
    spend = Spend()
    for at, replicas, needed in ((0.0, 2, 1), (60.0, 2, 1), (120.0, 4, 3)):
        spend.record(at, replicas, needed, window_s=600)
    single = spend.summary(120.0, 600)
    assert single == {"windowSeconds": 120, "replicaMinutes": 4.0, "neededReplicaMinutes": 2.0, "excess": 2.0}
    parallel = spend.summary(120.0, 600, devices=8)
    assert parallel == {**single, "deviceMinutes": 32.0, "neededDeviceMinutes": 16.0}
