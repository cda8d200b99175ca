-- Keep one shard group's part of an embedding table bounded, in the group's slot: remove the rows
-- (and the sighting records of IDs not admitted yet) not written since the expiry cutoff, over one
-- step of a scan of the table, and evict the least recently written rows beyond the group's row cap
-- (approximately, as Redis's own LRU does: among random samples, the oldest first).
--
-- While a checkpoint holds the group's table cut (`table_cut`, see apply.lua), each row removed whose
-- version is at most the cut's is first copied into the rows shadow, and each sighting record removed
-- into the seen shadow (HSETNX), so the save still finds what the cut held. Without a cut, shadows
-- left by a save that died are deleted.
--
-- Called through services.scripts.RowsSweepCall, which renders KEYS and ARGV by the names below.
-- KEYS[1] rows           the table's rows hash
-- KEYS[2] seen           its seen hash
-- KEYS[3] table_stats    the group's table counters
-- KEYS[4] table_cut      a checkpoint's cut of the group's tables (absent: none)
-- KEYS[5] rows_shadow    the table's rows shadow
-- KEYS[6] seen_shadow    its seen shadow
-- KEYS[7] version        the group's version
-- KEYS[8] feed           the group's changelog (GroupKeys.feed)
-- KEYS[9] feed_head      its last position
-- ARGV[1] table          the table's name (its counters are <table>:expired and <table>:evicted)
-- ARGV[2] written_at     1-based byte position of `written_ms` (u64, little-endian) in a row record
-- ARGV[3] cutoff_ms      remove what was last written (or sighted) before this; 0: no expiry
-- ARGV[4] cursor         where this step of the scan of the rows hash starts ('0': from the start)
-- ARGV[5] seen_cursor    where this step of the scan of the seen hash starts
-- ARGV[6] count          entries each scan step looks at
-- ARGV[7] cap            most rows this group keeps of the table; 0: no cap
-- ARGV[8] most_evicted   most rows one call evicts
-- ARGV[9] feed_entries   entries the group's feed keeps (about: MAXLEN ~)
--
-- A call that removed rows (expired or evicted alike) appends one entry to the group's feed at the
-- next position, in this script: `v` the group version (a sweep does not bump it), `ms` Redis's time,
-- `d` 0, `r:<table>` the IDs removed (8 bytes each): tombstones for whoever follows the feed.
--
-- Returns {next cursor of the rows scan, next cursor of the seen scan ('0': a pass is complete), rows
-- expired, rows evicted, sighting records expired, rows left}.
local K_ROWS = 1
local K_SEEN = 2
local K_TABLE_STATS = 3
local K_TABLE_CUT = 4
local K_ROWS_SHADOW = 5
local K_SEEN_SHADOW = 6
local K_VERSION = 7
local K_FEED = 8
local K_FEED_HEAD = 9
local A_TABLE = 1
local A_WRITTEN_AT = 2
local A_CUTOFF_MS = 3
local A_CURSOR = 4
local A_SEEN_CURSOR = 5
local A_COUNT = 6
local A_CAP = 7
local A_MOST_EVICTED = 8
local A_FEED_ENTRIES = 9

local at, cutoff = tonumber(ARGV[A_WRITTEN_AT]), tonumber(ARGV[A_CUTOFF_MS])
local count, cap, most = tonumber(ARGV[A_COUNT]), tonumber(ARGV[A_CAP]), tonumber(ARGV[A_MOST_EVICTED])
local function written(record)
  return (struct.unpack('<I8', record, at))
end
local function seen_at(record)  -- the SEEN_DTYPE record: count u32, then seen_ms u64
  return (struct.unpack('<I8', record, 5))
end

local cut_version = -1
local cut = redis.call('GET', KEYS[K_TABLE_CUT])
if cut then
  cut_version = tonumber(string.match(cut, '^(%d+) '))
else
  redis.call('UNLINK', KEYS[K_ROWS_SHADOW], KEYS[K_SEEN_SHADOW])
end
-- what a cut needs of a record about to be removed: a row of at most its version, any sighting record
local function keep_row(id, record)
  if cut_version >= 0 and struct.unpack('<I8', record) <= cut_version then
    redis.call('HSETNX', KEYS[K_ROWS_SHADOW], id, record)
  end
end
local function keep_seen(id, record)
  if cut_version >= 0 then
    redis.call('HSETNX', KEYS[K_SEEN_SHADOW], id, record)
  end
end

-- delete `fields` from `hash`, in calls of at most 4000 arguments (Lua's unpack has a stack limit)
local function hdel(hash, fields)
  for i = 1, #fields, 4000 do
    redis.call('HDEL', hash, unpack(fields, i, math.min(i + 3999, #fields)))
  end
end

local removed = {}  -- the IDs of the rows removed, for the feed
local function expire(hash, cursor, when, keep, gone)
  if cutoff == 0 then
    return '0', 0
  end
  local step = redis.call('HSCAN', hash, cursor, 'COUNT', count)
  local entries, old = step[2], {}
  for j = 1, #entries, 2 do
    if when(entries[j + 1]) < cutoff then
      keep(entries[j], entries[j + 1])
      old[#old + 1] = entries[j]
      if gone then
        gone[#gone + 1] = entries[j]
      end
    end
  end
  hdel(hash, old)
  return step[1], #old
end

local cursor, expired = expire(KEYS[K_ROWS], ARGV[A_CURSOR], written, keep_row, removed)
local seen_cursor, seen_expired = expire(KEYS[K_SEEN], ARGV[A_SEEN_CURSOR], seen_at, keep_seen, nil)

local evicted = 0
if cap > 0 then
  local over = redis.call('HLEN', KEYS[K_ROWS]) - cap
  while over > 0 and evicted < most do
    -- the oldest quarter of a random sample of 64 (at least one) goes, until the cap holds
    local sample = redis.call('HRANDFIELD', KEYS[K_ROWS], 64, 'WITHVALUES')
    local ages = {}
    for j = 1, #sample, 2 do
      ages[#ages + 1] = {written(sample[j + 1]), sample[j], sample[j + 1]}
    end
    table.sort(ages, function(a, b) return a[1] < b[1] end)
    local take = math.min(math.max(1, math.floor(#ages / 4)), over, most - evicted)
    local victims = {}
    for j = 1, take do
      victims[j] = ages[j][2]
      removed[#removed + 1] = ages[j][2]
      keep_row(ages[j][2], ages[j][3])
    end
    hdel(KEYS[K_ROWS], victims)
    evicted = evicted + take
    over = over - take
  end
end

local name = ARGV[A_TABLE]
if expired > 0 then
  redis.call('HINCRBY', KEYS[K_TABLE_STATS], name .. ':expired', expired)
end
if evicted > 0 then
  redis.call('HINCRBY', KEYS[K_TABLE_STATS], name .. ':evicted', evicted)
end
if #removed > 0 then
  local now = redis.call('TIME')
  local position = redis.call('INCR', KEYS[K_FEED_HEAD])
  redis.call('XADD', KEYS[K_FEED], 'MAXLEN', '~', ARGV[A_FEED_ENTRIES], position .. '-0',
             'v', redis.call('GET', KEYS[K_VERSION]) or '0', 'ms', now[1] * 1000 + math.floor(now[2] / 1000),
             'd', 0, 'r:' .. name, table.concat(removed))
end
return {cursor, seen_cursor, expired, evicted, seen_expired, redis.call('HLEN', KEYS[K_ROWS])}
