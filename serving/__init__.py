"""The serving replica (``streamtrain serve``): a copy of a job's model that follows the feed and answers
predictions in the Open Inference Protocol. See docs/serving.md, *The serving replica*."""
