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
{{- $dlq := default (dict) (get $policy "dlq") -}}
{{- $_ := set $dlq "path" "/data/dlq.sqlite3" -}}
{{- if include "retry-sidecar.dlqOnVolume" . }}
{{- /* The DLQ may hold half of its volume: the rest is room for SQLite's WAL, its -shm, free
pages and per-row overhead, so that "full" refuses records before the disk does. */ -}}
{{- $size := .Values.dlq.persistence.size -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- $volume := mul (regexFind "^[0-9]+" $size | int64) (get $units (regexFind "(Ki|Mi|Gi|Ti)$" $size)) -}}
{{- $bound := div $volume 2 -}}
{{- if hasKey $dlq "max_bytes" }}
{{- $given := get $dlq "max_bytes" -}}
{{- if or (not (kindIs "float64" $given | or (kindIs "int" $given) | or (kindIs "int64" $given))) (gt (int64 $given) $bound) }}
{{- fail (printf "sidecar.policy.dlq.max_bytes must be a number of bytes at most half of dlq.persistence.size (%d): the rest of the volume is room for SQLite's WAL; leave it out to get that bound" $bound) }}
{{- end }}
{{- else }}
{{- $_ := set $dlq "max_bytes" $bound -}}
{{- end }}
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
{{- end }}

{{/* "true" when the DLQ is a SQLite file on the pod's volume: persistence on and the DLQ not
kept in the fleet's Redis (sidecar.policy.dlq.backend: redis), which needs no volume. */}}
{{- define "retry-sidecar.dlqOnVolume" -}}
{{- $dlq := default (dict) (get .Values.sidecar.policy "dlq") -}}
{{- if and .Values.dlq.persistence.enabled (ne (toString (get $dlq "backend")) "redis") }}true{{ end -}}
{{- end }}
