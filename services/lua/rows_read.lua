-- Read rows of a shard group's embedding tables by ID, in the group's slot, as of one group version
-- (a script runs atomically: every row returned is as the group's version left it). A trainer's
-- pull asks for each row's version and values (the prefix of the stored record); a server asks for
-- whole records and, for IDs without a row, their not-yet-admitted sighting record.
--
-- Called through services.scripts.RowsReadCall, which renders KEYS and ARGV by the names below.
-- KEYS[1] version         the group's version
-- KEYS[2..] tables        per table asked, in order: its rows hash, then its seen hash when its ask
--                         wants sighting records
-- ARGV[1] count           number of tables asked
-- ARGV[2..] asks          per table, 3 values: bytes of each record to return (a prefix of the
--                         stored one), 1 to look IDs without a row up in the seen hash or 0, and the
--                         IDs (8 little-endian bytes each, concatenated)
--
-- Returns {group version, then per table: mask, rows, seen}: mask holds one byte per ID asked, 1
-- for a row, 2 for a seen record, 0 for neither; rows the returned prefixes of the rows found, seen
-- the seen records found, each concatenated in the order asked (bulk bytes, never one reply per ID).
local K_VERSION = 1
local K_TABLES = 2
local A_COUNT = 1
local A_ASKS = 2

local chunk = 4000  -- HMGET fields per call (Lua's unpack has a stack limit)
local version = redis.call('GET', KEYS[K_VERSION]) or '0'
local out = {version}
local key = K_TABLES
local function hmget(hash, ids, from, to)
  local fields = {}
  for k = from, to do
    fields[#fields + 1] = string.sub(ids, 8 * k + 1, 8 * k + 8)
  end
  return redis.call('HMGET', hash, unpack(fields))
end
for t = 0, tonumber(ARGV[A_COUNT]) - 1 do
  local at = A_ASKS + 3 * t
  local width, want_seen, ids = tonumber(ARGV[at]), ARGV[at + 1] == '1', ARGV[at + 2]
  local rows_key = KEYS[key]
  local seen_key = want_seen and KEYS[key + 1] or nil
  key = key + (want_seen and 2 or 1)
  local n = #ids / 8
  local mask, rows, seen = {}, {}, {}
  local i = 0
  while i < n do
    local j = math.min(i + chunk, n)
    local got = hmget(rows_key, ids, i, j - 1)
    local missing = {}
    for k = 1, #got do
      local v = got[k]
      if v then
        mask[i + k] = '\1'
        rows[#rows + 1] = #v > width and string.sub(v, 1, width) or v  -- no copy of a whole record
      else
        mask[i + k] = '\0'
        missing[#missing + 1] = i + k - 1
      end
    end
    if seen_key and #missing > 0 then
      local fields = {}
      for _, k in ipairs(missing) do
        fields[#fields + 1] = string.sub(ids, 8 * k + 1, 8 * k + 8)
      end
      local s = redis.call('HMGET', seen_key, unpack(fields))
      for m = 1, #s do
        if s[m] then
          mask[missing[m] + 1] = '\2'
          seen[#seen + 1] = s[m]
        end
      end
    end
    i = j
  end
  out[#out + 1] = table.concat(mask)
  out[#out + 1] = table.concat(rows)
  out[#out + 1] = table.concat(seen)
end
return out
