package mmcache

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// catHash is sha256("image_url\x00https://example.com/cat.png"), docs/rules.md's example.
const catHash = "d50305b9b95c0802394f12dc4272f0ec02cff6be30df6ff1a9de0768010548c9"

// partsOf decodes body[key][i].content for every message i whose content is a list.
func partsOf(t *testing.T, raw []byte, key string) [][]map[string]any {
	t.Helper()
	var body map[string]json.RawMessage
	var messages []map[string]any
	if err := json.Unmarshal(raw, &body); err != nil {
		t.Fatalf("%v: %s", err, raw)
	}
	if err := json.Unmarshal(body[key], &messages); err != nil {
		t.Fatalf("%v: %s", err, raw)
	}
	var out [][]map[string]any
	for _, m := range messages {
		list, _ := m["content"].([]any)
		parts := []map[string]any{}
		for _, p := range list {
			parts = append(parts, p.(map[string]any))
		}
		out = append(out, parts)
	}
	return out
}

func TestItemHashIsTheRulesExample(t *testing.T) {
	if got := ItemHash("image_url", "https://example.com/cat.png"); got != catHash {
		t.Errorf("ItemHash = %s, want %s", got, catHash)
	}
}

func TestSetItemUUIDsNamesEveryChatMediaPartByItsItemHash(t *testing.T) {
	raw := []byte(`{"model": "m", "seed": 12345678901234567890, "temperature": 0.1,
		"messages": [{"role": "system", "content": "be brief"},
		{"role": "user", "content": [
			{"type": "text", "text": "what are these?"},
			{"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "auto"}},
			{"type": "image_url", "image_url": "https://x/bare.png"},
			{"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
			{"type": "audio_url", "audio_url": {"url": "https://x/s.mp3"}},
			{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
			{"type": "image_url", "image_url": {"url": "https://x/own.png"}, "uuid": "mine"},
			{"type": "image_url", "image_url": {"url": "https://x/null.png"}, "uuid": null},
			{"type": "image_url", "image_url": 7},
			{"type": "input_image", "image_url": "https://x/responses-only.png"}]}]}`)
	named, err := SetItemUUIDs(raw)
	if err != nil {
		t.Fatal(err)
	}
	parts := partsOf(t, named, "messages")[1]
	want := []any{nil, catHash, ItemHash("image_url", "https://x/bare.png"), ItemHash("video_url", "https://x/v.mp4"),
		ItemHash("audio_url", "https://x/s.mp3"), ItemHash("input_audio", "wav:UklGRg=="), "mine",
		ItemHash("image_url", "https://x/null.png"), nil, nil}
	if len(parts) != len(want) {
		t.Fatalf("parts = %v", parts)
	}
	for i, w := range want {
		if got := parts[i]["uuid"]; got != w {
			t.Errorf("part %d uuid = %v, want %v", i, got, w)
		}
	}
	if parts[1]["image_url"].(map[string]any)["detail"] != "auto" {
		t.Errorf("the part lost a field: %v", parts[1])
	}
	// every other value keeps its bytes: no float64 round trip of the seed
	if !strings.Contains(string(named), `"seed":12345678901234567890`) || !strings.Contains(string(named), `"temperature":0.1`) {
		t.Errorf("other fields changed: %s", named)
	}
}

func TestSetItemUUIDsNamesResponsesPartsAsChatNamesTheSameURL(t *testing.T) {
	raw := []byte(`{"model": "m", "input": [
		{"role": "user", "content": [
			{"type": "input_text", "text": "what is this?"},
			{"type": "input_image", "image_url": "https://example.com/cat.png", "detail": "auto"},
			{"type": "input_image", "file_id": "file-abc123", "detail": "auto"},
			{"type": "input_image", "image_url": null, "file_id": "file-null-url", "detail": "auto"},
			{"type": "input_file", "file_id": "file-pdf"},
			{"type": "image_url", "image_url": {"url": "https://x/chat-only.png"}}]},
		{"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"}]}`)
	named, err := SetItemUUIDs(raw)
	if err != nil {
		t.Fatal(err)
	}
	parts := partsOf(t, named, "input")[0]
	want := []any{nil, catHash, ItemHash("file_id", "file-abc123"), ItemHash("file_id", "file-null-url"), nil, nil}
	for i, w := range want {
		if got := parts[i]["uuid"]; got != w {
			t.Errorf("part %d uuid = %v, want %v", i, got, w)
		}
	}
	if !strings.Contains(string(named), `"arguments":"{}"`) {
		t.Errorf("the function call changed: %s", named)
	}
}

func TestSetItemUUIDsLeavesABodyWithoutMediaPartsAsItIs(t *testing.T) {
	for _, raw := range []string{
		`{"model": "m", "input": "just text"}`,
		`{"model": "m", "messages": [{"role": "user", "content": "hi"}]}`,
		`{"model": "e5", "input": ["embed", "this"]}`,
		`{"prompt": "x"}`,
	} {
		got, err := SetItemUUIDs([]byte(raw))
		if err != nil || string(got) != raw {
			t.Errorf("SetItemUUIDs(%s) = %s, %v; want it unchanged", raw, got, err)
		}
	}
	for _, raw := range []string{`[]`, `null`, `{"messages": `} {
		if _, err := SetItemUUIDs([]byte(raw)); err == nil {
			t.Errorf("SetItemUUIDs(%s): no error", raw)
		}
	}
}

func TestResponsesWrapsTheBytesAsIs(t *testing.T) {
	if got := string(Responses([]byte(`{"input":[]}`))); got != `{"responses":{"input":[]}}` {
		t.Errorf("Responses = %s", got)
	}
}

func TestMatchDecodesTheSourceOfEachEntryAndEmptyWhenNotGiven(t *testing.T) {
	s := serve(t, func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"request_items": [{"hash": "h", "size": 1, "modality": "image"}], "endpoints": [
			{"endpoint": "ns/a", "matched_items": [], "matched_weight": 0, "total_weight": 1, "score": 0, "source": "engine"},
			{"endpoint": "ns/b", "matched_items": [], "matched_weight": 0, "total_weight": 1, "score": 0}]}`))
	})
	resp, err := newClient(t, s.URL).Match(context.Background(), MatchRequest{Endpoints: []string{"ns/a", "ns/b"}, Body: map[string]any{}})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Endpoints[0].Source != "engine" || resp.Endpoints[1].Source != "" {
		t.Errorf("sources = %q, %q", resp.Endpoints[0].Source, resp.Endpoints[1].Source)
	}
}

// The gateway names each media part before it forwards the request to vLLM: the
// engine then names the item by the hash mmcache uses.
func ExampleSetItemUUIDs() {
	raw := []byte(`{"model": "m", "messages": [{"role": "user", "content": [
		{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}`)
	named, err := SetItemUUIDs(raw)
	if err != nil {
		panic(err)
	}
	fmt.Println(string(named))
	// Output:
	// {"messages":[{"content":[{"image_url":{"url":"https://example.com/cat.png"},"type":"image_url","uuid":"d50305b9b95c0802394f12dc4272f0ec02cff6be30df6ff1a9de0768010548c9"}],"role":"user"}],"model":"m"}
}
