-- Apply a batch of updates for one shard group, exactly once (compare-and-set).
-- Runs in the MULTI/EXEC that first SETs, under staging keys, the full bytes the batch writes
-- (compacted shards, and the group's optimizer state when it persists): on success they are
-- RENAMEd into place (no copy), on failure deleted, so either all of the batch's effects for
-- this group happen or none.
--
-- KEYS[1] this group's cursor, KEYS[2] versions, KEYS[3] model_version, KEYS[4] apply_progress,
-- KEYS[5] applied_clocks, KEYS[6] applied_samples, KEYS[7] update_log, KEYS[8] optimizer_steps,
-- KEYS[9] bases, KEYS[10] delta_floors, KEYS[11] unapplied, KEYS[12] this group's persisted cursor,
-- KEYS[13 .. 12+G] every group's persisted cursor, then plan.renames (staging key, destination)
-- pairs, then the delta streams and the gradient blob keys the plan names by KEYS index.
-- ARGV[1] the plan (msgpack):
--   cursor   the cursor the server read ('' when none)
--   groups   G
--   renames  number of (staging, destination) pairs
--   shards   per written shard {index, version read, ARGV index of its delta (0: none),
--            1 when its full bytes are written (it is compacted), KEYS index of its delta stream}
--   updates  per update, in log order {id, member id, clock, {applied_samples field, value, ...}}
--   persist  0, or {steps = {shard, step, ...}, trim = {{update id, KEYS index of its first blob,
--            number of blobs}, ...}}: the optimizer state (among the renames) is persisted as of
--            the batch's last update, and the updates every group's persisted state now
--            includes are removed from the log with their blobs
-- ARGV[2 ..] the deltas.
-- Returns {'OK', model version, updates completed by this call} or {'CURSOR', cursor} /
-- {'VERSION', index, version} when the state moved since the server read it (then only the
-- staging keys are deleted). The model version is bumped once per call that writes shards.
local plan = cmsgpack.unpack(ARGV[1])
local groups = plan.groups
local first_rename = 13 + groups
local function drop_staging(reply)
  for j = 0, plan.renames - 1 do
    redis.call('DEL', KEYS[first_rename + 2 * j])
  end
  return reply
end
local function id_le(a, b)  -- stream id a <= b
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  ams, aseq, bms, bseq = tonumber(ams), tonumber(aseq), tonumber(bms), tonumber(bseq)
  return ams < bms or (ams == bms and aseq <= bseq)
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
      floor = tonumber(redis.call('HGET', KEYS[9], index) or '0')
    end
    redis.call('HSET', KEYS[9], index, version)
    redis.call('HSET', KEYS[10], index, floor)
    redis.call('XTRIM', stream, 'MINID', (floor + 1) .. '-0')
  end
end

local completed = 0
local last = plan.cursor
for _, u in ipairs(plan.updates) do
  local id, member, clock, record = u[1], u[2], u[3], u[4]
  last = id
  local done = redis.call('HINCRBY', KEYS[4], id, 1)
  if done >= groups then
    redis.call('HDEL', KEYS[4], id)
    local prev = tonumber(redis.call('HGET', KEYS[5], member) or '0')
    if clock > prev then
      redis.call('HSET', KEYS[5], member, clock)
    end
    redis.call('XADD', KEYS[6], '*', unpack(record))
    redis.call('DECR', KEYS[11])
    completed = completed + 1
  end
end
redis.call('SET', KEYS[1], last)

if plan.persist ~= 0 then
  local steps = plan.persist.steps
  if #steps > 0 then
    redis.call('HSET', KEYS[8], unpack(steps))
  end
  if last ~= '' then
    redis.call('SET', KEYS[12], last)
  end
  -- an update leaves the log once every group's persisted state includes it
  local low = nil
  for g = 0, groups - 1 do
    local p = redis.call('GET', KEYS[13 + g])
    if not p then
      low = nil
      break
    end
    if low == nil or not id_le(low, p) then
      low = p
    end
  end
  if low then
    for _, t in ipairs(plan.persist.trim) do
      if id_le(t[1], low) then
        redis.call('XDEL', KEYS[7], t[1])
        if t[3] > 0 then
          redis.call('DEL', unpack(KEYS, t[2], t[2] + t[3] - 1))
        end
      end
    end
  end
end
return {'OK', version, completed}
