-- Keep one shard group's part of an embedding table bounded, in the group's slot: remove the rows
-- (and the sighting records of IDs not admitted yet) not written since the expiry cutoff, over one
-- step of a scan of the table, and evict the least recently written rows beyond the group's row cap
-- (approximately, as Redis's own LRU does: among random samples, the oldest first).
--
-- Called through services.scripts.RowsSweepCall, which renders KEYS and ARGV by the names below.
-- KEYS[1] rows           the table's rows hash
-- KEYS[2] seen           its seen hash
-- KEYS[3] table_stats    the group's table counters
-- ARGV[1] table          the table's name (its counters are <table>:expired and <table>:evicted)
-- ARGV[2] written_at     1-based byte position of `written_ms` (u64, little-endian) in a row record
-- ARGV[3] cutoff_ms      remove what was last written (or sighted) before this; 0: no expiry
-- ARGV[4] cursor         where this step of the scan of the rows hash starts ('0': from the start)
-- ARGV[5] seen_cursor    where this step of the scan of the seen hash starts
-- ARGV[6] count          entries each scan step looks at
-- ARGV[7] cap            most rows this group keeps of the table; 0: no cap
-- ARGV[8] most_evicted   most rows one call evicts
--
-- Returns {next cursor of the rows scan, next cursor of the seen scan ('0': a pass is complete), rows
-- expired, rows evicted, sighting records expired, rows left}.
local K_ROWS = 1
local K_SEEN = 2
local K_TABLE_STATS = 3
local A_TABLE = 1
local A_WRITTEN_AT = 2
local A_CUTOFF_MS = 3
local A_CURSOR = 4
local A_SEEN_CURSOR = 5
local A_COUNT = 6
local A_CAP = 7
local A_MOST_EVICTED = 8

local at, cutoff = tonumber(ARGV[A_WRITTEN_AT]), tonumber(ARGV[A_CUTOFF_MS])
local count, cap, most = tonumber(ARGV[A_COUNT]), tonumber(ARGV[A_CAP]), tonumber(ARGV[A_MOST_EVICTED])
local function written(record)
  return (struct.unpack('<I8', record, at))
end
local function seen_at(record)  -- the SEEN_DTYPE record: count u32, then seen_ms u64
  return (struct.unpack('<I8', record, 5))
end

-- delete `fields` from `hash`, in calls of at most 4000 arguments (Lua's unpack has a stack limit)
local function hdel(hash, fields)
  for i = 1, #fields, 4000 do
    redis.call('HDEL', hash, unpack(fields, i, math.min(i + 3999, #fields)))
  end
end

local function expire(hash, cursor, when)
  if cutoff == 0 then
    return '0', 0
  end
  local step = redis.call('HSCAN', hash, cursor, 'COUNT', count)
  local entries, old = step[2], {}
  for j = 1, #entries, 2 do
    if when(entries[j + 1]) < cutoff then
      old[#old + 1] = entries[j]
    end
  end
  hdel(hash, old)
  return step[1], #old
end

local cursor, expired = expire(KEYS[K_ROWS], ARGV[A_CURSOR], written)
local seen_cursor, seen_expired = expire(KEYS[K_SEEN], ARGV[A_SEEN_CURSOR], seen_at)

local evicted = 0
if cap > 0 then
  local over = redis.call('HLEN', KEYS[K_ROWS]) - cap
  while over > 0 and evicted < most do
    -- the oldest quarter of a random sample of 64 (at least one) goes, until the cap holds
    local sample = redis.call('HRANDFIELD', KEYS[K_ROWS], 64, 'WITHVALUES')
    local ages = {}
    for j = 1, #sample, 2 do
      ages[#ages + 1] = {written(sample[j + 1]), sample[j]}
    end
    table.sort(ages, function(a, b) return a[1] < b[1] end)
    local take = math.min(math.max(1, math.floor(#ages / 4)), over, most - evicted)
    local victims = {}
    for j = 1, take do
      victims[j] = ages[j][2]
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
return {cursor, seen_cursor, expired, evicted, seen_expired, redis.call('HLEN', KEYS[K_ROWS])}
