"""streamtrain: distributed training from Kafka streams with a Redis parameter server."""

__version__ = "0.1.0"
