-- Apply one update for one shard group, exactly once (compare-and-set).
-- KEYS[1] this group's cursor, KEYS[2] versions, KEYS[3] model_version, KEYS[4] apply_progress,
-- KEYS[5] applied_clocks, KEYS[6] applied_samples, KEYS[7] update_log, KEYS[8] optimizer_steps,
-- KEYS[9..] per written shard: its shard key, then its optimizer slot keys.
-- ARGV[1] cursor the server read ('' when none), ARGV[2] update id, ARGV[3] number of groups,
-- ARGV[4] member id, ARGV[5] clock, ARGV[6] written shards s, ARGV[7] slots per shard k,
-- ARGV[8] number m of applied_samples field/value pairs, ARGV[9 .. 8+2m] those pairs,
-- then per written shard: index, version the server read, optimizer step, bytes, k slot bytes.
-- Returns {'OK', model version, groups done} or {'CURSOR', cursor} / {'VERSION', index, version}
-- when the state moved since the server read it (nothing is written then).
local cursor = redis.call('GET', KEYS[1]) or ''
if cursor ~= ARGV[1] then
  return {'CURSOR', cursor}
end
local s, k, m = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local base = 9 + 2 * m
local per = 4 + k
for j = 0, s - 1 do
  local idx = ARGV[base + per * j]
  local v = redis.call('HGET', KEYS[2], idx) or '0'
  if v ~= ARGV[base + per * j + 1] then
    return {'VERSION', idx, v}
  end
end
local version
if s > 0 then
  version = redis.call('INCR', KEYS[3])
else
  version = tonumber(redis.call('GET', KEYS[3]) or '0')
end
for j = 0, s - 1 do
  local a = base + per * j
  local kb = 9 + (1 + k) * j
  redis.call('SET', KEYS[kb], ARGV[a + 3])
  redis.call('HSET', KEYS[2], ARGV[a], version)
  redis.call('HSET', KEYS[8], ARGV[a], ARGV[a + 2])
  for slot = 1, k do
    redis.call('SET', KEYS[kb + slot], ARGV[a + 3 + slot])
  end
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
end
return {'OK', version, done}
