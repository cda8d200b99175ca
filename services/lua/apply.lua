-- Apply a batch of n >= 1 updates for one shard group, exactly once (compare-and-set).
-- Runs in the MULTI/EXEC that first SETs the group's final shard and optimizer bytes (after all
-- the batch's updates, applied in order in the server's memory) under staging keys: on success
-- they are RENAMEd into place (no copy), on failure deleted, so either all of the batch's effects
-- for this group happen or none.
-- KEYS[1] this group's cursor, KEYS[2] versions, KEYS[3] model_version, KEYS[4] apply_progress,
-- KEYS[5] applied_clocks, KEYS[6] applied_samples, KEYS[7] update_log, KEYS[8] optimizer_steps,
-- KEYS[9 ..] per written shard, (1 + k) pairs of (staging key, destination key): the shard, then
-- its k optimizer slots; then the gradient blob keys of every update, in batch order.
-- ARGV[1] cursor the server read ('' when none), ARGV[2] number of groups, ARGV[3] written
-- shards s, ARGV[4] slots per shard k, ARGV[5] updates n,
-- then per written shard: index, version the server read, optimizer step after the batch;
-- then per update, in log order: id, member id, clock, b (its blob keys), m (its applied_samples
-- field/value pairs), those 2m values.
-- Returns {'OK', model version, updates completed by this call} or {'CURSOR', cursor} /
-- {'VERSION', index, version} when the state moved since the server read it (then only the
-- staging keys are deleted). The model version is bumped once per call that writes shards.
local groups, s, k, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local pairs_per = 1 + k
local function drop_staging(reply)
  for j = 0, s * pairs_per - 1 do
    redis.call('DEL', KEYS[9 + 2 * j])
  end
  return reply
end
local cursor = redis.call('GET', KEYS[1]) or ''
if cursor ~= ARGV[1] then
  return drop_staging({'CURSOR', cursor})
end
for j = 0, s - 1 do
  local idx = ARGV[6 + 3 * j]
  local v = redis.call('HGET', KEYS[2], idx) or '0'
  if v ~= ARGV[7 + 3 * j] then
    return drop_staging({'VERSION', idx, v})
  end
end
local version
if s > 0 then
  version = redis.call('INCR', KEYS[3])
else
  version = tonumber(redis.call('GET', KEYS[3]) or '0')
end
for j = 0, s * pairs_per - 1 do
  redis.call('RENAME', KEYS[9 + 2 * j], KEYS[10 + 2 * j])
end
for j = 0, s - 1 do
  local idx = ARGV[6 + 3 * j]
  redis.call('HSET', KEYS[2], idx, version)
  redis.call('HSET', KEYS[8], idx, ARGV[8 + 3 * j])
end
local a = 6 + 3 * s
local blob = 9 + 2 * pairs_per * s
local completed = 0
local last = ARGV[1]
for _ = 1, n do
  local id, member, clock = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local b, m = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local first_field = a + 5
  last = id
  local done = redis.call('HINCRBY', KEYS[4], id, 1)
  if done >= groups then
    redis.call('HDEL', KEYS[4], id)
    local prev = tonumber(redis.call('HGET', KEYS[5], member) or '0')
    if clock > prev then
      redis.call('HSET', KEYS[5], member, clock)
    end
    redis.call('XADD', KEYS[6], '*', unpack(ARGV, first_field, first_field + 2 * m - 1))
    redis.call('XDEL', KEYS[7], id)
    if b > 0 then
      redis.call('DEL', unpack(KEYS, blob, blob + b - 1))
    end
    completed = completed + 1
  end
  blob = blob + b
  a = first_field + 2 * m
end
redis.call('SET', KEYS[1], last)
return {'OK', version, completed}
