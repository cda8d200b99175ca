-- Apply one update for one shard group, exactly once (compare-and-set).
-- Runs in the MULTI/EXEC that first SETs the new shard and optimizer bytes under staging keys:
-- on success they are RENAMEd into place (no copy), on failure deleted, so either all of the
-- update's effects for this group happen or none.
-- KEYS[1] this group's cursor, KEYS[2] versions, KEYS[3] model_version, KEYS[4] apply_progress,
-- KEYS[5] applied_clocks, KEYS[6] applied_samples, KEYS[7] update_log, KEYS[8] optimizer_steps,
-- KEYS[9 ..] per written shard, (1 + k) pairs of (staging key, destination key): the shard, then
-- its k optimizer slots; then the update's gradient blob keys (deleted when fully applied).
-- ARGV[1] cursor the server read ('' when none), ARGV[2] update id, ARGV[3] number of groups,
-- ARGV[4] member id, ARGV[5] clock, ARGV[6] written shards s, ARGV[7] slots per shard k,
-- ARGV[8] number m of applied_samples field/value pairs, ARGV[9 .. 8+2m] those pairs,
-- then per written shard: index, version the server read, optimizer step.
-- Returns {'OK', model version, groups done} or {'CURSOR', cursor} / {'VERSION', index, version}
-- when the state moved since the server read it (then only the staging keys are deleted).
local s, k, m = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local base = 9 + 2 * m
local pairs_per = 1 + k
local first_blob = 9 + 2 * pairs_per * s
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
  local idx = ARGV[base + 3 * j]
  local v = redis.call('HGET', KEYS[2], idx) or '0'
  if v ~= ARGV[base + 3 * j + 1] then
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
  local idx = ARGV[base + 3 * j]
  redis.call('HSET', KEYS[2], idx, version)
  redis.call('HSET', KEYS[8], idx, ARGV[base + 3 * j + 2])
end
redis.call('SET', KEYS[1], ARGV[2])
local done = redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
if done >= tonumber(ARGV[3]) then
  redis.call('HDEL', KEYS[4], ARGV[2])
  local prev = tonumber(redis.call('HGET', KEYS[5], ARGV[4]) or '0')
  if tonumber(ARGV[5]) > prev then
    redis.call('HSET', KEYS[5], ARGV[4], ARGV[5])
  end
  local fields = {}
  for i = 9, 8 + 2 * m do
    fields[#fields + 1] = ARGV[i]
  end
  redis.call('XADD', KEYS[6], '*', unpack(fields))
  redis.call('XDEL', KEYS[7], ARGV[2])
  if #KEYS >= first_blob then
    redis.call('DEL', unpack(KEYS, first_blob))
  end
end
return {'OK', version, done}
