package mmcache

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
)

// SetItemUUIDs returns an OpenAI request body, chat completions (a "messages" list) or
// Responses (an "input" list), with every media part that has no "uuid" given one:
// its item hash, computed as mmcache computes it (docs/rules.md). Send the result to
// vLLM, which takes a part's uuid as the item's name in its encoder cache
// (multi_modal_uuids): the engine then reports its cache (/v1/engine-events) with the
// hashes that mmcache estimates with, so estimate, engine and mmcache name every item
// alike.
//
// The hashes do not change: a part whose uuid is its own content hash hashes the same
// with or without it, so the body can go to mmcache before or after this call. Parts
// that already carry a uuid keep it (mmcache then uses that uuid as the hash). A part
// this cannot hash (a malformed one, which mmcache refuses with a 400 naming it) is
// left as it is. Only the media parts change; every other value keeps its bytes
// (object keys come out sorted).
//
// raw is the OpenAI body itself, not a body wrapped by ChatCompletions or Responses.
func SetItemUUIDs(raw []byte) ([]byte, error) {
	var body map[string]json.RawMessage
	if err := json.Unmarshal(raw, &body); err != nil {
		return nil, err
	}
	if body == nil {
		return nil, errors.New("mmcache: the request body is not a JSON object")
	}
	for _, key := range []string{"messages", "input"} {
		list, ok := body[key]
		if !ok || !isArray(list) {
			continue
		}
		updated, changed, err := setInMessages(list, key == "input")
		if err != nil || !changed {
			return raw, err
		}
		body[key] = updated
		return json.Marshal(body)
	}
	return raw, nil
}

// ItemHash is the item hash of one media reference: sha256(namespace + "\x00" +
// reference) in lower-case hex, the rule the Go plugin and mmcache share (namespace
// "image_url", "video_url", "audio_url", "input_audio" with reference format + ":" +
// data, or "file_id").
func ItemHash(namespace, reference string) string {
	sum := sha256.Sum256([]byte(namespace + "\x00" + reference))
	return hex.EncodeToString(sum[:])
}

// setInMessages names the media parts of every message of list, a chat-completions
// "messages" list or a Responses "input" list (responses).
func setInMessages(list json.RawMessage, responses bool) (json.RawMessage, bool, error) {
	var messages []json.RawMessage
	if err := json.Unmarshal(list, &messages); err != nil {
		return nil, false, err
	}
	changed := false
	for i, raw := range messages {
		var message map[string]json.RawMessage
		if json.Unmarshal(raw, &message) != nil || message == nil || !isArray(message["content"]) {
			continue // not a message with a list of parts: nothing to name
		}
		var parts []json.RawMessage
		if err := json.Unmarshal(message["content"], &parts); err != nil {
			return nil, false, err
		}
		partsChanged := false
		for j, part := range parts {
			if named, ok := withUUID(part, responses); ok {
				parts[j], partsChanged = named, true
			}
		}
		if !partsChanged {
			continue
		}
		content, err := json.Marshal(parts)
		if err != nil {
			return nil, false, err
		}
		message["content"] = content
		if messages[i], err = json.Marshal(message); err != nil {
			return nil, false, err
		}
		changed = true
	}
	if !changed {
		return list, false, nil
	}
	out, err := json.Marshal(messages)
	return out, true, err
}

// withUUID is the part with "uuid" set to its item hash, if it is a media part
// without one that can be hashed.
func withUUID(raw json.RawMessage, responses bool) (json.RawMessage, bool) {
	var part map[string]json.RawMessage
	if json.Unmarshal(raw, &part) != nil || part == nil {
		return nil, false
	}
	if _, given := nonNull(part["uuid"]); given {
		return nil, false // a uuid of its own is kept (and is the hash mmcache uses)
	}
	kind, ok := jsonString(part["type"])
	if !ok {
		return nil, false
	}
	namespace, reference, ok := mediaReference(kind, part, responses)
	if !ok {
		return nil, false
	}
	hash, err := json.Marshal(ItemHash(namespace, reference))
	if err != nil {
		return nil, false
	}
	part["uuid"] = hash
	out, err := json.Marshal(part)
	return out, err == nil
}

// mediaReference is what a media part's hash is made of (docs/rules.md): the chat
// part types image_url, video_url, audio_url and input_audio, or the Responses ones
// input_image and input_audio.
func mediaReference(kind string, part map[string]json.RawMessage, responses bool) (namespace, reference string, ok bool) {
	switch {
	case kind == "input_audio":
		var audio struct {
			Data   json.RawMessage `json:"data"`
			Format json.RawMessage `json:"format"`
		}
		if json.Unmarshal(part[kind], &audio) != nil {
			return "", "", false
		}
		data, okData := jsonString(audio.Data)
		format, okFormat := jsonString(audio.Format)
		return kind, format + ":" + data, okData && okFormat
	case responses && kind == "input_image": // a URL (or data URL) hashes as chat's image_url
		if url, ok := jsonString(part["image_url"]); ok {
			return "image_url", url, true
		}
		if _, given := nonNull(part["image_url"]); given {
			return "", "", false
		}
		fileID, ok := jsonString(part["file_id"])
		return "file_id", fileID, ok
	case !responses && (kind == "image_url" || kind == "video_url" || kind == "audio_url"):
		if kind == "image_url" {
			if url, ok := jsonString(part[kind]); ok {
				return kind, url, true // the bare-string form
			}
		}
		var object map[string]json.RawMessage
		if json.Unmarshal(part[kind], &object) != nil || object == nil {
			return "", "", false
		}
		url, ok := jsonString(object["url"])
		return kind, url, ok
	}
	return "", "", false
}

// jsonString is the string a JSON value holds; ok is false for anything else
// (absent, null, a number, an object).
func jsonString(raw json.RawMessage) (string, bool) {
	value, given := nonNull(raw)
	if !given || value[0] != '"' {
		return "", false
	}
	var s string
	return s, json.Unmarshal(value, &s) == nil
}

// nonNull is raw without surrounding space; given is false when it is absent or null.
func nonNull(raw json.RawMessage) (json.RawMessage, bool) {
	trimmed := bytes.TrimSpace(raw)
	return trimmed, len(trimmed) > 0 && !bytes.Equal(trimmed, []byte("null"))
}

func isArray(raw json.RawMessage) bool {
	trimmed, given := nonNull(raw)
	return given && trimmed[0] == '['
}
