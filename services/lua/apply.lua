-- Apply a batch of updates for one shard group, exactly once (compare-and-set).
-- Runs in the MULTI/EXEC that first SETs, under staging keys, the full bytes the batch writes
-- (compacted shards, and the group's optimizer state when it persists): on success they are
-- RENAMEd into place (no copy), on failure deleted, so either all of the batch's effects for
-- this group happen or none.
--
-- KEYS[1] this group's cursor, KEYS[2] versions, KEYS[3] model_version, KEYS[4] apply_progress,
-- KEYS[5] applied_clocks, KEYS[6] applied_samples, KEYS[7] update_log, KEYS[8] optimizer_steps,
-- KEYS[9] bases, KEYS[10] delta_floors, KEYS[11] unapplied, KEYS[12] this group's persisted cursor,
-- KEYS[13] members, KEYS[14] clocks, KEYS[15] staleness, KEYS[16] audit_floor,
-- KEYS[17 .. 16+G] every group's persisted cursor, then plan.renames (staging key, destination)
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
--   housekeep 0, or {horizon ms (0: keep applied_samples forever), most entries to trim}: the
--            server's periodic housekeeping (see below); ordinary writes carry 0 and pay nothing
-- ARGV[2 ..] the deltas.
--
-- Bounded state. The group that completes an update of a member no longer in `members` (it left
-- or expired; ids are never reused, and a departed member is fenced from pushing) removes the
-- member's `clocks`, `applied_clocks` and `staleness` fields once all its pushed updates are
-- applied. Housekeeping also sweeps those hashes for departed members with nothing pending, and
-- trims the `applied_samples` entries older than the horizon (by Redis's clock: entry ids are
-- its ms timestamps), oldest first, raising in the same step each partition's `audit_floor` to the
-- highest `next` offset of the trimmed entries: the records below it are no longer accounted one
-- by one (entries complete in log order, and a partition's ranges in log order are contiguous).
--
-- Returns {'OK', model version, updates completed by this call, applied_samples entries trimmed,
-- 1 when more entries are past the horizon than one call trims (else 0), departed members whose
-- fields were removed} or {'CURSOR', cursor} /
-- {'VERSION', index, version} when the state moved since the server read it (then only the
-- staging keys are deleted). The model version is bumped once per call that writes shards.
local plan = cmsgpack.unpack(ARGV[1])
local groups = plan.groups
local first_rename = 17 + groups
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

-- a departed member's per-member fields go once everything it pushed is applied (`applied`: its
-- applied clock, when the caller knows it)
local function forget_if_done(member, applied)
  if redis.call('HEXISTS', KEYS[13], member) == 1 then
    return 0
  end
  applied = applied or tonumber(redis.call('HGET', KEYS[5], member) or '0')
  if applied < tonumber(redis.call('HGET', KEYS[14], member) or '0') then
    return 0
  end
  redis.call('HDEL', KEYS[14], member)
  redis.call('HDEL', KEYS[5], member)
  redis.call('HDEL', KEYS[15], member)
  return 1
end

local completed = 0
local forgotten = 0
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
      prev = clock
    end
    forgotten = forgotten + forget_if_done(member, prev)
    redis.call('XADD', KEYS[6], '*', unpack(record))
    redis.call('DECR', KEYS[11])
    completed = completed + 1
  end
end
redis.call('SET', KEYS[1], last)

local trimmed, more = 0, 0
if plan.housekeep and plan.housekeep ~= 0 then
  local horizon_ms, most = plan.housekeep[1], plan.housekeep[2]
  local seen = {}
  for _, key in ipairs({KEYS[14], KEYS[5], KEYS[15]}) do
    for _, member in ipairs(redis.call('HKEYS', key)) do
      if not seen[member] then
        seen[member] = true
        forgotten = forgotten + forget_if_done(member, nil)
      end
    end
  end
  if horizon_ms > 0 then
    local now = redis.call('TIME')
    local cutoff = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - horizon_ms
    if cutoff > 0 then
      -- an end id of only ms reaches its last sequence number: every entry of ms < cutoff
      local old = redis.call('XRANGE', KEYS[6], '-', string.format('%d', cutoff - 1), 'COUNT', most)
      local floors = {}
      local function raise_floors(text)
        for _, range in ipairs(cjson.decode(text)) do
          local p, nxt = string.format('%d', range[1]), tonumber(range[3])
          if floors[p] == nil or nxt > floors[p] then
            floors[p] = nxt
          end
        end
      end
      for _, entry in ipairs(old) do
        local fields = entry[2]
        for j = 1, #fields, 2 do
          if fields[j] == 'offsets' then
            -- pcall: an error would leave the writes above done and the reply an error (a
            -- malformed entry, which the server never writes, just raises no floor)
            pcall(raise_floors, fields[j + 1])
          end
        end
      end
      for p, nxt in pairs(floors) do
        if nxt > tonumber(redis.call('HGET', KEYS[16], p) or '0') then
          redis.call('HSET', KEYS[16], p, string.format('%d', nxt))
        end
      end
      trimmed = #old
      if trimmed > 0 then
        local ms, seq = string.match(old[trimmed][1], '^(%d+)-(%d+)$')
        redis.call('XTRIM', KEYS[6], 'MINID', ms .. '-' .. string.format('%d', tonumber(seq) + 1))
      end
      if trimmed == most then
        more = 1
      end
    end
  end
end

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
    local p = redis.call('GET', KEYS[17 + g])
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
return {'OK', version, completed, trimmed, more, forgotten}
