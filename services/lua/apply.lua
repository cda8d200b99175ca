-- Apply a batch of updates to one shard group's parameters, exactly once (compare-and-set), in the
-- group's own hash slot. Runs in the MULTI/EXEC that first SETs, under staging keys, the full bytes
-- the batch writes (compacted shards, and the group's optimizer state when it persists): on success
-- they are RENAMEd into place (no copy), on failure deleted, so either all of the batch's effects
-- for this group happen or none. The accounting of the batch (the job's slot: `account.lua`) is
-- written by the next call; this script stores its plan in `unaccounted`, atomically with the
-- apply, so a server killed in between finishes it on restart.
--
-- Called through services.scripts.ApplyCall, which renders KEYS and ARGV by the names below;
-- tests/test_protocol.py checks that these lines, the K_/A_/S_ locals and the class agree.
-- KEYS[1] cursor
-- KEYS[2] versions
-- KEYS[3] version
-- KEYS[4] optimizer_steps
-- KEYS[5] bases
-- KEYS[6] delta_floors
-- KEYS[7] persisted
-- KEYS[8] unaccounted
-- KEYS[9..] renames       plan.renames (staging key, destination) pairs, then the delta streams and
--                         the gradient blob keys that the plan names by KEYS index
-- ARGV[1] plan            msgpack, below
-- ARGV[2] accounting      the accounting plan to keep in `unaccounted` ('' for none)
-- ARGV[3..] deltas        the deltas that the plan names by ARGV index
-- The plan:
--   cursor   the cursor the server read ('' when none)
--   last     the cursor after the batch (its last update; = cursor when the batch has none)
--   renames  number of (staging, destination) pairs
--   shards   per written shard, a ShardPlan {index, version read, ARGV index of its delta (0: none),
--            1 when its full bytes are written (it is compacted), KEYS index of its delta stream}
--   persist  0, or {steps = {shard, step, ...}, blobs = {KEYS index of the first, count}}: the
--            optimizer state (among the renames) is persisted as of `last`, and the group's gradient
--            blobs of the updates it now includes are deleted (only this group reads them)
--
-- Returns {'OK', group version} or {'CURSOR', cursor} / {'VERSION', index, version} when the state
-- moved since the server read it (then only the staging keys are deleted). The group version is
-- bumped once per call that writes shards.
local K_CURSOR = 1
local K_VERSIONS = 2
local K_VERSION = 3
local K_OPTIMIZER_STEPS = 4
local K_BASES = 5
local K_DELTA_FLOORS = 6
local K_PERSISTED = 7
local K_UNACCOUNTED = 8
local K_RENAMES = 9
local A_PLAN = 1
local A_ACCOUNTING = 2
local A_DELTAS = 3  -- (the plan names each delta by its ARGV index)
-- the fields of each plan.shards entry, by position (ShardPlan)
local S_INDEX = 1
local S_VERSION_READ = 2
local S_DELTA = 3
local S_FULL = 4
local S_STREAM = 5

local plan = cmsgpack.unpack(ARGV[A_PLAN])
local function drop_staging(reply)
  for j = 0, plan.renames - 1 do
    redis.call('DEL', KEYS[K_RENAMES + 2 * j])
  end
  return reply
end

local cursor = redis.call('GET', KEYS[K_CURSOR]) or ''
if cursor ~= plan.cursor then
  return drop_staging({'CURSOR', cursor})
end
for _, sh in ipairs(plan.shards) do
  local v = redis.call('HGET', KEYS[K_VERSIONS], sh[S_INDEX]) or '0'
  if tonumber(v) ~= sh[S_VERSION_READ] then
    return drop_staging({'VERSION', sh[S_INDEX], v})
  end
end

local version
if #plan.shards > 0 then
  version = redis.call('INCR', KEYS[K_VERSION])
else
  version = tonumber(redis.call('GET', KEYS[K_VERSION]) or '0')
end
for j = 0, plan.renames - 1 do
  redis.call('RENAME', KEYS[K_RENAMES + 2 * j], KEYS[K_RENAMES + 2 * j + 1])
end
for _, sh in ipairs(plan.shards) do
  local index, stream = sh[S_INDEX], KEYS[sh[S_STREAM]]
  redis.call('HSET', KEYS[K_VERSIONS], index, version)
  if sh[S_DELTA] > 0 then
    redis.call('XADD', stream, version .. '-0', 'd', ARGV[sh[S_DELTA]])
  end
  if sh[S_FULL] == 1 then
    -- compacted: the full bytes are the new base; keep the deltas since the previous base
    -- (pullers that hold a version after it still move only what changed), or none when the
    -- whole shard changed (there is no delta at this version)
    local floor = version
    if sh[S_DELTA] > 0 then
      floor = tonumber(redis.call('HGET', KEYS[K_BASES], index) or '0')
    end
    redis.call('HSET', KEYS[K_BASES], index, version)
    redis.call('HSET', KEYS[K_DELTA_FLOORS], index, floor)
    redis.call('XTRIM', stream, 'MINID', (floor + 1) .. '-0')
  end
end
if plan.last ~= '' then
  redis.call('SET', KEYS[K_CURSOR], plan.last)
end
if ARGV[A_ACCOUNTING] ~= '' then
  redis.call('SET', KEYS[K_UNACCOUNTED], ARGV[A_ACCOUNTING])
end
if plan.persist ~= 0 then
  local steps = plan.persist.steps
  if #steps > 0 then
    redis.call('HSET', KEYS[K_OPTIMIZER_STEPS], unpack(steps))
  end
  if plan.last ~= '' then
    redis.call('SET', KEYS[K_PERSISTED], plan.last)
  end
  local first, count = plan.persist.blobs[1], plan.persist.blobs[2]
  if count > 0 then
    redis.call('DEL', unpack(KEYS, first, first + count - 1))
  end
end
return {'OK', version}
