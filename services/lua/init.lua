-- Create a job's model once: first writer wins.
-- KEYS[1] meta, KEYS[2] versions, KEYS[3] bases, KEYS[4] delta_floors, KEYS[5] model_version,
-- KEYS[6..] shard keys
-- ARGV[1] meta JSON, ARGV[2..] shard bytes (same order as KEYS[6..])
-- Returns the meta JSON now stored (ours, or the earlier writer's).
local existing = redis.call('GET', KEYS[1])
if existing then
  return existing
end
for i = 6, #KEYS do
  local index = tostring(i - 6)
  redis.call('SET', KEYS[i], ARGV[i - 4])
  redis.call('HSET', KEYS[2], index, '0')
  redis.call('HSET', KEYS[3], index, '0')
  redis.call('HSET', KEYS[4], index, '0')
end
redis.call('SET', KEYS[5], '0')
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
