-- Apply a batch of updates to one shard group's parameters, exactly once (compare-and-set), in the
-- group's own hash slot. Runs in the MULTI/EXEC that first SETs, under staging keys, the full bytes
-- the batch writes (compacted shards, and the group's optimizer state when it persists): on success
-- they are RENAMEd into place (no copy), on failure deleted, so either all of the batch's effects
-- for this group happen or none. The accounting of the batch (the job's slot: `account.lua`) is
-- written by the next call; this script stores its plan in `unaccounted`, atomically with the
-- apply, so a server killed in between finishes it on restart.
--
-- KEYS[1] cursor, KEYS[2] versions, KEYS[3] version, KEYS[4] optimizer_steps, KEYS[5] bases,
-- KEYS[6] delta_floors, KEYS[7] persisted, KEYS[8] unaccounted,
-- KEYS[9 ..] plan.renames (staging key, destination) pairs, then the delta streams and the
-- gradient blob keys the plan names by KEYS index.
-- ARGV[1] the plan (msgpack):
--   cursor   the cursor the server read ('' when none)
--   last     the cursor after the batch (its last update; = cursor when the batch has none)
--   renames  number of (staging, destination) pairs
--   shards   per written shard {index, version read, ARGV index of its delta (0: none),
--            1 when its full bytes are written (it is compacted), KEYS index of its delta stream}
--   persist  0, or {steps = {shard, step, ...}, blobs = {KEYS index of the first, count}}: the
--            optimizer state (among the renames) is persisted as of `last`, and the group's gradient
--            blobs of the updates it now includes are deleted (only this group reads them)
-- ARGV[2] the accounting plan to keep in `unaccounted` ('' for none), ARGV[3 ..] the deltas.
--
-- Returns {'OK', group version} or {'CURSOR', cursor} / {'VERSION', index, version} when the state
-- moved since the server read it (then only the staging keys are deleted). The group version is
-- bumped once per call that writes shards.
local plan = cmsgpack.unpack(ARGV[1])
local first_rename = 9
local function drop_staging(reply)
  for j = 0, plan.renames - 1 do
    redis.call('DEL', KEYS[first_rename + 2 * j])
  end
  return reply
end

local cursor = redis.call('GET', KEYS[1]) or ''
if cursor ~= plan.cursor then
  return drop_staging({'CURSOR', cursor})
end
for _, sh in ipairs(plan.shards) do
  local v = redis.call('HGET', KEYS[2], sh[1]) or '0'
  if tonumber(v) ~= sh[2] then
    return drop_staging({'VERSION', sh[1], v})
  end
end

local version
if #plan.shards > 0 then
  version = redis.call('INCR', KEYS[3])
else
  version = tonumber(redis.call('GET', KEYS[3]) or '0')
end
for j = 0, plan.renames - 1 do
  redis.call('RENAME', KEYS[first_rename + 2 * j], KEYS[first_rename + 2 * j + 1])
end
for _, sh in ipairs(plan.shards) do
  local index, stream = sh[1], KEYS[sh[5]]
  redis.call('HSET', KEYS[2], index, version)
  if sh[3] > 0 then
    redis.call('XADD', stream, version .. '-0', 'd', ARGV[sh[3]])
  end
  if sh[4] == 1 then
    -- compacted: the full bytes are the new base; keep the deltas since the previous base
    -- (pullers that hold a version after it still move only what changed), or none when the
    -- whole shard changed (there is no delta at this version)
    local floor = version
    if sh[3] > 0 then
      floor = tonumber(redis.call('HGET', KEYS[5], index) or '0')
    end
    redis.call('HSET', KEYS[5], index, version)
    redis.call('HSET', KEYS[6], index, floor)
    redis.call('XTRIM', stream, 'MINID', (floor + 1) .. '-0')
  end
end
if plan.last ~= '' then
  redis.call('SET', KEYS[1], plan.last)
end
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[8], ARGV[2])
end
if plan.persist ~= 0 then
  local steps = plan.persist.steps
  if #steps > 0 then
    redis.call('HSET', KEYS[4], unpack(steps))
  end
  if plan.last ~= '' then
    redis.call('SET', KEYS[7], plan.last)
  end
  local first, count = plan.persist.blobs[1], plan.persist.blobs[2]
  if count > 0 then
    redis.call('DEL', unpack(KEYS, first, first + count - 1))
  end
end
return {'OK', version}
