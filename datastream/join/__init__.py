"""The joiner: impressions and their delayed feedback become labelled training records, in event time,
exactly once (Kafka transactions). See docs/join.md."""
