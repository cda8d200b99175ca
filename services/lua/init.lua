-- Create a job's model once: first writer wins.
-- KEYS[1] meta, KEYS[2] versions, KEYS[3] model_version, KEYS[4..] shard keys
-- ARGV[1] meta JSON, ARGV[2..] shard bytes (same order as KEYS[4..])
-- Returns the meta JSON now stored (ours, or the earlier writer's).
local existing = redis.call('GET', KEYS[1])
if existing then
  return existing
end
for i = 4, #KEYS do
  redis.call('SET', KEYS[i], ARGV[i - 2])
  redis.call('HSET', KEYS[2], tostring(i - 4), '0')
end
redis.call('SET', KEYS[3], '0')
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
