{{/* The chart name. */}}
{{- define "retry-sidecar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* A fully qualified app name, at most 63 characters. */}}
{{- define "retry-sidecar.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "retry-sidecar.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels. */}}
{{- define "retry-sidecar.labels" -}}
helm.sh/chart: {{ include "retry-sidecar.chart" . }}
{{ include "retry-sidecar.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels. */}}
{{- define "retry-sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "retry-sidecar.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "retry-sidecar.secretName" -}}
{{- default (printf "%s-admin" (include "retry-sidecar.fullname" .)) .Values.sidecar.adminToken.existingSecret }}
{{- end }}

{{/* The variable the sidecar reads the fleet Redis's password from (fleet.redis.password_env). */}}
{{- define "retry-sidecar.redisPasswordEnv" -}}
RETRY_SIDECAR_REDIS_PASSWORD
{{- end }}

{{/* The sidecar's whole config: the user's policy plus what the chart owns. */}}
{{- define "retry-sidecar.config" -}}
{{- $app := printf "http://127.0.0.1:%d" (int .Values.app.port) -}}
{{- $policy := deepCopy .Values.sidecar.policy -}}
{{- $routes := list -}}
{{- range $policy.routes }}
{{- $r := deepCopy . }}
{{- if eq (toString (get $r "upstream")) "{{APP}}" }}{{- $_ := set $r "upstream" $app }}{{- end }}
{{- $routes = append $routes $r }}
{{- end }}
{{- $_ := set $policy "routes" $routes -}}
{{- $_ := set $policy "version" 1 -}}
{{- $_ := set $policy "name" (include "retry-sidecar.fullname" .) -}}
{{- $_ := set $policy "listen" (printf "0.0.0.0:%d" (int .Values.sidecar.proxyPort)) -}}
{{- $_ := set $policy "admin" (dict "listen" (printf "0.0.0.0:%d" (int .Values.sidecar.adminPort)) "token_env" "RETRY_SIDECAR_ADMIN_TOKEN" "allowed_hosts" (default (list) .Values.sidecar.adminAllowedHosts)) -}}
{{- /* The volume at /data holds the SQLite files: the DLQ's, and the idempotency keys' when a
route enables idempotency with the sqlite backend. Half of it holds records and keys (each
store's max_bytes), the rest is room for the WALs, their -shm, free pages and per-row overhead,
so that "full" refuses records before the disk does. With both files on it, that half is split
in two: a quarter of the volume for each. */ -}}
{{- $dlqOnVolume := include "retry-sidecar.dlqOnVolume" . -}}
{{- $keysOnVolume := include "retry-sidecar.idempotencyOnVolume" . -}}
{{- $volume := include "retry-sidecar.volumeBytes" . | int64 -}}
{{- $share := ternary 4 2 (and (not (empty $dlqOnVolume)) (not (empty $keysOnVolume))) -}}
{{- $shareText := ternary "a quarter" "half" (eq $share 4) -}}
{{- $dlq := default (dict) (get $policy "dlq") -}}
{{- $_ := set $dlq "path" "/data/dlq.sqlite3" -}}
{{- if $dlqOnVolume }}
{{- $bound := div $volume $share -}}
{{- if hasKey $dlq "max_bytes" }}
{{- $given := get $dlq "max_bytes" -}}
{{- if or (not (kindIs "float64" $given | or (kindIs "int" $given) | or (kindIs "int64" $given))) (gt (int64 $given) $bound) }}
{{- fail (printf "sidecar.policy.dlq.max_bytes must be a number of bytes at most %s of dlq.persistence.size (%d): the rest of the volume is room for SQLite's WAL%s; leave it out to get that bound" $shareText $bound (ternary " and the idempotency keys" "" (eq $share 4))) }}
{{- end }}
{{- else }}
{{- $_ := set $dlq "max_bytes" $bound -}}
{{- end }}
{{- end }}
{{- $idem := default (dict) (get $policy "idempotency") -}}
{{- if ne (toString (get $idem "backend")) "redis" }}
{{- /* The keys' file on the volume too (the root filesystem is read-only). Its bounds: bytes as
the DLQ's, and one key per KEY_DISK bytes of that share: a small key (an in-progress claim)
counts about 200 bytes in the tally but takes about 350 on disk with its three indexes, so
max_bytes alone would let many small keys outgrow their share. */ -}}
{{- $_ := set $idem "path" "/data/idempotency.sqlite3" -}}
{{- if $keysOnVolume }}
{{- $bytes := div $volume $share -}}
{{- $records := div $bytes (include "retry-sidecar.keyDiskBytes" . | int64) -}}
{{- range $name, $bound := dict "max_bytes" $bytes "max_records" $records }}
{{- if hasKey $idem $name }}
{{- $given := get $idem $name -}}
{{- if or (not (kindIs "float64" $given | or (kindIs "int" $given) | or (kindIs "int64" $given))) (gt (int64 $given) $bound) }}
{{- fail (printf "sidecar.policy.idempotency.%s must be a number at most %d (%s of dlq.persistence.size%s): the rest of the volume is room for SQLite's WAL%s; leave it out to get that bound" $name $bound $shareText (ternary ", one key per 512 bytes" "" (eq $name "max_records")) (ternary " and the DLQ" "" (eq $share 4))) }}
{{- end }}
{{- else }}
{{- $_ := set $idem $name $bound -}}
{{- end }}
{{- end }}
{{- end }}
{{- $_ := set $policy "idempotency" $idem -}}
{{- end }}
{{- $_ := set $policy "dlq" $dlq -}}
{{- with .Values.fleet }}
{{- if .redis.url }}
{{- /* Fleet mode: the Redis and what is shared through it; its password comes from the Secret
the container's env names (retry-sidecar.sidecarContainer). */ -}}
{{- $redis := dict "url" .redis.url "key_prefix" .redis.keyPrefix "timeout" .redis.timeout "password_env" (include "retry-sidecar.redisPasswordEnv" $) -}}
{{- $_ := set $policy "fleet" (dict "redis" $redis "killswitch" .killswitch) -}}
{{- end }}
{{- end }}
{{- with .Values.sidecar.tls.listener }}
{{- if .secretName }}
{{- /* The listener's kubernetes.io/tls Secret, mounted at /etc/tls/listener
(retry-sidecar.sidecarContainer); re-read by the sidecar when the Secret is updated. */ -}}
{{- $tls := dict "cert_file" "/etc/tls/listener/tls.crt" "key_file" "/etc/tls/listener/tls.key" "min_version" (toString .minVersion) -}}
{{- if .clientCa }}{{- $_ := set $tls "client_ca_file" "/etc/tls/listener/ca.crt" -}}{{- end }}
{{- $_ := set $policy "server_tls" $tls -}}
{{- end }}
{{- end }}
{{- $_ := set $policy "drain_timeout" (printf "%ds" (int .Values.sidecar.drainTimeoutSeconds)) -}}
{{- toYaml $policy }}
{{- end }}

{{/* The sidecar container (used as a native init-container sidecar or a classic container). */}}
{{- define "retry-sidecar.sidecarContainer" -}}
- name: retry-sidecar
  image: "{{ .Values.sidecar.image.repository }}:{{ .Values.sidecar.image.tag | default .Chart.AppVersion }}"
  imagePullPolicy: {{ .Values.sidecar.image.pullPolicy }}
  {{- if .Values.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  args: ["run", "--config", "/etc/retry-sidecar/sidecar.yaml"]
  env:
    - name: RETRY_SIDECAR_CONFIG
      value: /etc/retry-sidecar/sidecar.yaml
    - name: RETRY_SIDECAR_ADMIN_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "retry-sidecar.secretName" . }}
          key: {{ .Values.sidecar.adminToken.secretKey }}
    {{- if and .Values.fleet.redis.url .Values.fleet.redis.password.existingSecret }}
    - name: {{ include "retry-sidecar.redisPasswordEnv" . }}
      valueFrom:
        secretKeyRef:
          name: {{ .Values.fleet.redis.password.existingSecret }}
          key: {{ .Values.fleet.redis.password.secretKey }}
    {{- end }}
    {{- with .Values.sidecar.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: proxy
      containerPort: {{ .Values.sidecar.proxyPort }}
      protocol: TCP
    - name: admin
      containerPort: {{ .Values.sidecar.adminPort }}
      protocol: TCP
  startupProbe:
    httpGet: {path: /readyz, port: admin}
    periodSeconds: 1
    failureThreshold: 30
  readinessProbe:
    httpGet: {path: /readyz, port: admin}
    periodSeconds: 5
    failureThreshold: 2
  livenessProbe:
    # Liveness checks only that the process and its event loop answer.
    httpGet: {path: /healthz, port: admin}
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml .Values.sidecar.resources | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 10001
    runAsGroup: 10001
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    capabilities: {drop: [ALL]}
    seccompProfile: {type: RuntimeDefault}
  volumeMounts:
    # The ConfigMap as a directory (never subPath, which is never updated), for hot reload.
    - name: policy
      mountPath: /etc/retry-sidecar
      readOnly: true
    - name: dlq
      mountPath: /data
    {{- if .Values.sidecar.tls.listener.secretName }}
    - name: tls-listener
      mountPath: /etc/tls/listener
      readOnly: true
    {{- end }}
    {{- range .Values.sidecar.tls.mounts }}
    - name: tls-{{ .name }}
      mountPath: /etc/tls/{{ .name }}
      readOnly: true
    {{- end }}
{{- end }}

{{/* "true" when the DLQ is a SQLite file on the pod's volume: persistence on and the DLQ not
kept in the fleet's Redis (sidecar.policy.dlq.backend: redis), which needs no volume. */}}
{{- define "retry-sidecar.dlqOnVolume" -}}
{{- $dlq := default (dict) (get .Values.sidecar.policy "dlq") -}}
{{- if and .Values.dlq.persistence.enabled (ne (toString (get $dlq "backend")) "redis") }}true{{ end -}}
{{- end }}


{{/* "true" when idempotency keys are kept in a SQLite file (not the fleet's Redis) and the
policy enables idempotency (in defaults or on a route): the file is written only then. */}}
{{- define "retry-sidecar.idempotencyInFile" -}}
{{- $policy := .Values.sidecar.policy -}}
{{- $idem := default (dict) (get $policy "idempotency") -}}
{{- $defaults := default (dict) (get $policy "defaults") -}}
{{- $used := get (default (dict) (get $defaults "idempotency")) "enabled" -}}
{{- range (default (list) (get $policy "routes")) }}
{{- if get (default (dict) (get . "idempotency")) "enabled" }}{{ $used = true }}{{ end }}
{{- end }}
{{- if and $used (ne (toString (get $idem "backend")) "redis") }}true{{ end -}}
{{- end }}

{{/* "true" when the idempotency keys' SQLite file is on the pod's volume (persistence on). */}}
{{- define "retry-sidecar.idempotencyOnVolume" -}}
{{- if and .Values.dlq.persistence.enabled (include "retry-sidecar.idempotencyInFile" .) }}true{{ end -}}
{{- end }}

{{/* "true" when the pod gets a volume claim: a SQLite file of the DLQ's or the keys' on it. */}}
{{- define "retry-sidecar.persistent" -}}
{{- if or (include "retry-sidecar.dlqOnVolume" .) (include "retry-sidecar.idempotencyOnVolume" .) }}true{{ end -}}
{{- end }}

{{/* dlq.persistence.size in bytes. */}}
{{- define "retry-sidecar.volumeBytes" -}}
{{- $size := .Values.dlq.persistence.size -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- mul (regexFind "^[0-9]+" $size | int64) (get $units (regexFind "(Ki|Mi|Gi|Ti)$" $size)) -}}
{{- end }}

{{/* Disk bytes allowed per idempotency key in the volume's share: max_records = share / this. */}}
{{- define "retry-sidecar.keyDiskBytes" -}}
512
{{- end }}
