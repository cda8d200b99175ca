"""The floor every plane stands on: Redis key names, settings from flags and environment,
a spec's ``?key=value`` options, riding out a dependency's outage, and URL helpers.

Nothing here imports a plane (``services``, ``coordinator``, ``trainers``,
``datastream``) or the roof (``streamtrain``): arrows only point down to it.
"""
