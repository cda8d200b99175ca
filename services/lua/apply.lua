-- Apply a batch of updates to one shard group's parameters, exactly once (compare-and-set), in the
-- group's own hash slot. Runs in the MULTI/EXEC that first SETs, under staging keys, the full bytes
-- the batch writes (compacted shards, and the group's optimizer state when it persists): on success
-- they are RENAMEd into place (no copy), on failure deleted, so either all of the batch's effects
-- for this group happen or none. The accounting of the batch (the job's slot: `account.lua`) is
-- written by the next call; this script stores its plan in `unaccounted`, atomically with the
-- apply, so a server killed in between finishes it on restart.
--
-- Called through services.scripts.ApplyCall, which renders KEYS and ARGV by the names below;
-- tests/test_services_protocol.py checks that these lines, the K_/A_/S_ locals and the class agree.
-- KEYS[1] cursor
-- KEYS[2] versions
-- KEYS[3] version
-- KEYS[4] optimizer_steps
-- KEYS[5] bases
-- KEYS[6] delta_floors
-- KEYS[7] persisted
-- KEYS[8] unaccounted
-- KEYS[9] table_stats
-- KEYS[10] table_cut       a checkpoint's cut of the group's tables (absent: none; below)
-- KEYS[11] rows_blob_shadow
-- KEYS[12] feed            the group's changelog (below)
-- KEYS[13] feed_head       its last position
-- KEYS[14..] renames      plan.renames (staging key, destination) pairs, then the delta streams, the
--                         gradient blob keys, the row-gradient blob keys and the tables' rows, seen,
--                         rows shadow and seen shadow hashes, which the plan names by KEYS index
-- ARGV[1] plan            msgpack, below
-- ARGV[2] accounting      the accounting plan to keep in `unaccounted` ('' for none)
-- ARGV[3..] deltas        the deltas, then the tables' ID blobs, that the plan names by ARGV index
-- The plan:
--   cursor   the cursor the server read ('' when none)
--   last     the cursor after the batch (its last update; = cursor when the batch has none)
--   version  the group version the server read (compare-and-set when it writes rows: they are
--            stamped with the next)
--   renames  number of (staging, destination) pairs
--   shards   per written shard, a ShardPlan {index, version read, ARGV index of its delta (0: none),
--            1 when its full bytes are written (it is compacted), KEYS index of its delta stream}
--   persist  0, or {steps = {shard, step, ...}, blobs = {KEYS index of the first, count}}: the
--            optimizer state (among the renames) is persisted as of `last`, and the group's gradient
--            blobs of the updates it now includes are deleted (only this group reads them)
--   row_blobs {KEYS index of the first, count}: the row-gradient blobs of the batch's updates,
--            deleted now (their rows are written here with their optimizer state: nothing replays them)
--   rows     rows written in all (a call that writes rows bumps the version)
--   feed     entries the group's feed keeps (about: MAXLEN ~)
--   tables   per table touched, a TablePlan {name, KEYS index of its rows hash, KEYS index of its
--            seen hash, ARGV index of the IDs of the rows written (0: none), ARGV index of the IDs of
--            the seen records written (0: none), ARGV index of the IDs whose seen record goes (0:
--            none), the table's step count, rows admitted, gradient rows dropped, KEYS index of its
--            rows shadow, KEYS index of its seen shadow}; each blob of IDs holds 8 little-endian
--            bytes per ID
--
-- The rows and sighting records themselves are not written here: Redis spends about twice as much
-- CPU on a script's arguments (each becomes a Lua string, then a Redis string again) as on the
-- writes. They follow this script in the same MULTI/EXEC as native HSET/HDEL commands of
-- field/value arguments (services.server.apply.write_batch), a transaction that only runs under a
-- WATCH of `cursor`, `versions` and `version` after the server has checked them against the plan,
-- so this script's compare-and-set cannot fail when they run (a state that moved aborts the EXEC).
--
-- While a checkpoint holds the group's table cut (`table_cut` = "<version> <owner> <blobs>",
-- services.snapshot.checkpoint), the old record of each row this call overwrites is first copied into the
-- table's rows shadow when its version (its first 8 bytes) is at most the cut's: the row as the
-- cut saw it (HSETNX: only the first copy after the cut counts; a row written after the cut has a
-- higher version and needs none). Sighting records carry no version: the old one of each ID whose
-- sighting record is written or deleted goes into the seen shadow, '' when there was none, once
-- per ID. With <blobs> = 1 the row-gradient blobs this call deletes are copied into
-- `rows_blob_shadow` first (the save reads them there).
--
-- A call that bumps the group version appends one entry to the group's feed (GroupKeys.feed), at
-- the next position (feed_head + 1, its ID <position>-0): the new version `v`, Redis's time `ms`,
-- `d` = 1 when shards changed, and per table whose rows it writes `w:<table>` = the IDs written (the
-- plan's ARGV, as they are). Written in this script, the entry can never disagree with the rows.
--
-- Returns {'OK', group version} or {'CURSOR', cursor} / {'VERSION', index, version} / {'GROUP',
-- version} when the state moved since the server read it (then only the staging keys are deleted).
-- The group version is bumped once per call that writes shards or rows.
local K_CURSOR = 1
local K_VERSIONS = 2
local K_VERSION = 3
local K_OPTIMIZER_STEPS = 4
local K_BASES = 5
local K_DELTA_FLOORS = 6
local K_PERSISTED = 7
local K_UNACCOUNTED = 8
local K_TABLE_STATS = 9
local K_TABLE_CUT = 10
local K_ROWS_BLOB_SHADOW = 11
local K_FEED = 12
local K_FEED_HEAD = 13
local K_RENAMES = 14
local A_PLAN = 1
local A_ACCOUNTING = 2
local A_DELTAS = 3  -- (the plan names each delta by its ARGV index)
-- the fields of each plan.shards entry, by position (ShardPlan)
local S_INDEX = 1
local S_VERSION_READ = 2
local S_DELTA = 3
local S_FULL = 4
local S_STREAM = 5
-- the fields of each plan.tables entry, by position (TablePlan)
local T_NAME = 1
local T_ROWS = 2
local T_SEEN = 3
local T_ROW_IDS = 4
local T_SEEN_IDS = 5
local T_UNSEEN = 6
local T_STEPS = 7
local T_ADMITTED = 8
local T_DROPPED = 9
local T_ROWS_SHADOW = 10
local T_SEEN_SHADOW = 11

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
if #plan.tables > 0 then
  -- rows are stamped with the next group version: it must still be the one the server read
  local group_version = tonumber(redis.call('GET', KEYS[K_VERSION]) or '0')
  if group_version ~= plan.version then
    return drop_staging({'GROUP', group_version})
  end
end

-- the old records a checkpoint's cut needs, copied before anything is overwritten or deleted
local first_row_blob, row_blobs = plan.row_blobs[1], plan.row_blobs[2]
local cut_version, cut_blobs = -1, false
if #plan.tables > 0 or row_blobs > 0 then
  local cut = redis.call('GET', KEYS[K_TABLE_CUT])
  if cut then
    local v, b = string.match(cut, '^(%d+) %S+ (%d)$')
    cut_version, cut_blobs = tonumber(v), b == '1'
  end
end
-- the records of `ids` (8 bytes each) in `hash`, in calls of at most 4000 fields: fn(id, record or
-- false) (per row, but only while a checkpoint holds the cut)
local function each_old(hash, ids, fn)
  local n = #ids / 8
  for i = 0, n - 1, 4000 do
    local fields = {}
    for k = i, math.min(i + 4000, n) - 1 do
      fields[#fields + 1] = string.sub(ids, 8 * k + 1, 8 * k + 8)
    end
    local old = redis.call('HMGET', hash, unpack(fields))
    for j = 1, #fields do
      fn(fields[j], old[j])
    end
  end
end
if cut_version >= 0 then
  for _, t in ipairs(plan.tables) do
    local rows_shadow, seen_shadow = KEYS[t[T_ROWS_SHADOW]], KEYS[t[T_SEEN_SHADOW]]
    local function keep_row(id, old)
      if old and struct.unpack('<I8', old) <= cut_version then
        redis.call('HSETNX', rows_shadow, id, old)
      end
    end
    local function keep_seen(id, old)
      redis.call('HSETNX', seen_shadow, id, old or '')
    end
    if t[T_ROW_IDS] > 0 then
      each_old(KEYS[t[T_ROWS]], ARGV[t[T_ROW_IDS]], keep_row)
    end
    if t[T_SEEN_IDS] > 0 then
      each_old(KEYS[t[T_SEEN]], ARGV[t[T_SEEN_IDS]], keep_seen)
    end
    if t[T_UNSEEN] > 0 then
      each_old(KEYS[t[T_SEEN]], ARGV[t[T_UNSEEN]], keep_seen)
    end
  end
  if cut_blobs then
    for j = first_row_blob, first_row_blob + row_blobs - 1 do
      local blob = redis.call('GET', KEYS[j])
      if blob then
        redis.call('HSETNX', KEYS[K_ROWS_BLOB_SHADOW], KEYS[j], blob)
      end
    end
  end
end

local version
if #plan.shards > 0 or plan.rows > 0 then
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
for _, t in ipairs(plan.tables) do
  redis.call('HSET', KEYS[K_TABLE_STATS], t[T_NAME] .. ':steps', t[T_STEPS])
  if t[T_ADMITTED] > 0 then
    redis.call('HINCRBY', KEYS[K_TABLE_STATS], t[T_NAME] .. ':admitted', t[T_ADMITTED])
  end
  if t[T_DROPPED] > 0 then
    redis.call('HINCRBY', KEYS[K_TABLE_STATS], t[T_NAME] .. ':dropped', t[T_DROPPED])
  end
end
if #plan.shards > 0 or plan.rows > 0 then
  local now = redis.call('TIME')
  local entry = {'v', version, 'ms', now[1] * 1000 + math.floor(now[2] / 1000), 'd', #plan.shards > 0 and 1 or 0}
  for _, t in ipairs(plan.tables) do
    if t[T_ROW_IDS] > 0 then
      entry[#entry + 1] = 'w:' .. t[T_NAME]
      entry[#entry + 1] = ARGV[t[T_ROW_IDS]]
    end
  end
  local position = redis.call('INCR', KEYS[K_FEED_HEAD])
  redis.call('XADD', KEYS[K_FEED], 'MAXLEN', '~', plan.feed, position .. '-0', unpack(entry))
end
if row_blobs > 0 then
  redis.call('DEL', unpack(KEYS, first_row_blob, first_row_blob + row_blobs - 1))
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
